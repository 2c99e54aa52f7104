"""Decoding a call's argument text, which is model output: it may be anything, including JSON nested deeper
than Python's recursion limit (a few thousand `[` fit in one max_tokens budget)."""

from __future__ import annotations

import json


def load_arguments(text: str) -> tuple[object | None, str | None]:
    """(decoded value, None), or (None, why it is not JSON); never raises on any text."""
    try:
        return json.loads(text), None
    except json.JSONDecodeError as err:
        return None, f"arguments are not valid JSON: {err}"
    except RecursionError:
        return None, "arguments are not valid JSON: nested too deeply"
