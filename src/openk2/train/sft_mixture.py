"""The SFT data mixture: conversations (procedural tool chat, files, synthesized trajectories) plus a share of
pre-training text, so fine-tuning does not forget the corpus (K2 report, section 3.1; issue 22, item 5).

Synthesized data is what `openk2 synth run` writes to `sft.jsonl` in its output directory (one accepted
trajectory per line: {"messages", "tools", "meta"}; see `openk2.agentic.pipeline`). It is model output, so
it is read defensively: a line that is not JSON, not a renderable conversation or has no assistant turn is
skipped and counted by reason, never trusted; call ids are rewritten to K2's `functions.NAME:IDX` form
(`k2_call_ids`). Trajectories are split into training and held-out ones by
their task id (a seeded hash, so a task's samples stay on one side and the split does not move when the
synthesis run grows); the held-out ones become tool-call prompts: the conversation up to the first assistant
turn that calls a tool, with that call as the expected answer.

Pre-training rows: with `sft.pretrain_fraction = f`, row k of the training stream (counting every row of
every batch from the start of the run) is a pre-training row exactly when floor((k + 1) f) > floor(k f), so
the share is exact at every point and needs no random state. A pre-training row is the next window of
the run's `[data]` corpus (train split; the validation split stays unseen for the perplexity measurement)
at `sft.seq_len` tokens, with the loss on every token as in pre-training (one segment, positions 0..T-1,
attention across its documents exactly as `openk2 pretrain` trains).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from openk2.chat.tool_parsers.kimi_k2 import format_call_id
from openk2.data.conversations import ConversationLoader, conversation_pieces
from openk2.data.corpus import CorpusConfig
from openk2.data.loader import PackedLoader
from openk2.data.packing import IGNORE_INDEX
from openk2.data.tokenizer import K2Tokenizer

SYNTH_FILE = "sft.jsonl"  # the accepted trajectories of an `openk2 synth run` output directory
STATE_VERSION = 1


# ---------------------------------------------------------------------------------------------- synthesized data
@dataclass
class SynthData:
    """Synthesized trajectories split by task: `train` conversations, `heldout` ones, and what was skipped."""

    train: list[dict] = field(default_factory=list)  # {"messages", "tools"}
    heldout: list[dict] = field(default_factory=list)
    skipped: Counter = field(default_factory=Counter)  # reason -> lines

    def summary(self) -> str:
        skipped = ", ".join(f"{n} {reason}" for reason, n in sorted(self.skipped.items())) or "none"
        return f"{len(self.train)} train, {len(self.heldout)} held-out trajectories; skipped: {skipped}"


def synth_file(path: str | Path) -> Path:
    """The `sft.jsonl` of a synthesis output directory, or the file itself."""
    path = Path(path)
    resolved = path / SYNTH_FILE if path.is_dir() else path
    if not resolved.is_file():
        raise ValueError(f"synthesized data {path}: no {SYNTH_FILE} there (run `openk2 synth run` first)")
    return resolved


def is_heldout(task_id: str, fraction: float, seed: int) -> bool:
    """Whether a task is held out: a seeded hash of its id, uniform in [0, 1), below `fraction`."""
    digest = hashlib.sha256(f"synth-heldout-{seed}:{task_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def k2_call_ids(messages: list) -> list:
    """`messages` with every tool-call id rewritten to K2's `functions.NAME:IDX` (IDX counting the calls of the
    conversation) and each tool result's `tool_call_id` following its call. The chat template renders ids
    verbatim and K2's parser reads the function name from the id, so an OpenAI-style `call_2` id would teach
    the model calls that no K2 parser can attribute to a function."""
    renamed: dict[str, str] = {}
    out, index = [], 0
    for message in messages:
        role = message.get("role") if isinstance(message, dict) else None
        if role == "assistant" and isinstance(message.get("tool_calls"), list):
            calls = []
            for call in message["tool_calls"]:
                name = call.get("function", {}).get("name") if isinstance(call, dict) else None
                if isinstance(name, str):
                    new_id = format_call_id(name, index)
                    index += 1
                    if isinstance(call.get("id"), str):
                        renamed.setdefault(call["id"], new_id)
                    call = {**call, "id": new_id}
                calls.append(call)
            message = {**message, "tool_calls": calls}
        elif role == "tool" and message.get("tool_call_id") in renamed:
            message = {**message, "tool_call_id": renamed[message["tool_call_id"]]}
        out.append(message)
    return out


def _check_record(record: object) -> tuple[dict, str] | str:
    """(conversation, task id) of one synthesized line, or why it is skipped."""
    if not isinstance(record, dict) or not isinstance(record.get("messages"), list):
        return "not a trajectory object"
    try:
        conversation = {"messages": k2_call_ids(record["messages"])}
    except (TypeError, AttributeError):
        return "not a renderable conversation"
    if record.get("tools") is not None:
        conversation["tools"] = record["tools"]
    try:
        conversation_pieces(conversation)
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError):  # model output: malformed is a skip
        return "not a renderable conversation"
    meta = record.get("meta") if isinstance(record.get("meta"), dict) else {}
    task_id = meta.get("task_id")
    return conversation, str(task_id) if task_id is not None else json.dumps(record["messages"][:2])[:200]


def read_synthesized(paths: Sequence[str | Path], heldout_fraction: float, seed: int = 0) -> SynthData:
    """Read synthesis outputs (directories or `sft.jsonl` files), skipping malformed lines, split by task."""
    if not 0 <= heldout_fraction < 1:
        raise ValueError(f"synth_heldout must lie in [0, 1), got {heldout_fraction}")
    data = SynthData()
    for path in paths:
        with synth_file(path).open(encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except (json.JSONDecodeError, RecursionError):
                    data.skipped["not JSON"] += 1
                    continue
                checked = _check_record(record)
                if isinstance(checked, str):
                    data.skipped[checked] += 1
                    continue
                conversation, task_id = checked
                side = data.heldout if is_heldout(task_id, heldout_fraction, seed) else data.train
                side.append(conversation)
    return data


def tool_call_prompts(conversations: Sequence[dict]) -> list[dict]:
    """Held-out prompts {"messages", "tools", "expected"} from conversations: everything before the first
    assistant turn that calls a tool, and that call (name, arguments as a JSON object) as the expected one."""
    prompts = []
    for conversation in conversations:
        messages, tools = conversation["messages"], conversation.get("tools") or []
        for i, message in enumerate(messages):
            calls = message.get("tool_calls") if message.get("role") == "assistant" else None
            if not calls or not isinstance(calls, list):
                continue
            function = calls[0].get("function") if isinstance(calls[0], dict) else None
            try:
                arguments = json.loads(function["arguments"])
                name = function["name"]
            except (TypeError, KeyError, ValueError, RecursionError):
                break
            if i > 0 and isinstance(arguments, dict) and isinstance(name, str):
                prompts.append({"messages": messages[:i], "tools": tools,
                                "expected": {"name": name, "arguments": arguments}})
            break
    return prompts


# ---------------------------------------------------------------------------------------------- mixing rows
def is_pretrain_row(k: int, fraction: float) -> bool:
    """Whether row k of the stream is a pre-training row: exactly round-down(n f) of the first n rows are."""
    return math.floor((k + 1) * fraction) > math.floor(k * fraction)


def pretrain_loader(corpus: CorpusConfig, tokenizer: K2Tokenizer, seq_len: int) -> PackedLoader:
    """The corpus's training windows of `seq_len` tokens, one row per batch."""
    return PackedLoader(dataclasses.replace(corpus, seq_len=seq_len), tokenizer, batch_size=1, split="train")


class MixedLoader:
    """Batches {input_ids, labels, position_ids, segment_ids} ([B, seq_len]) of packed conversations with a share
    `fraction` of pre-training rows at fixed stream positions (see `is_pretrain_row`); resumable."""

    def __init__(self, conversations: ConversationLoader, pretrain: PackedLoader | None, fraction: float,
                 batch_size: int) -> None:
        if not 0 <= fraction < 1:
            raise ValueError(f"pretrain_fraction must lie in [0, 1), got {fraction}")
        if fraction > 0 and pretrain is None:
            raise ValueError("pretrain_fraction > 0 needs a pre-training loader")
        if pretrain is not None and pretrain.config.seq_len != conversations.seq_len:
            raise ValueError(f"pre-training rows of {pretrain.config.seq_len} tokens do not match seq_len "
                             f"{conversations.seq_len}")
        self.conversations, self.pretrain, self.fraction = conversations, pretrain, fraction
        self.batch_size, self.seq_len = batch_size, conversations.seq_len
        self.rows = 0  # rows emitted so far
        self.labels = {"sft": 0, "pretrain": 0}  # labelled (trained-on) tokens emitted per kind

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        rows = []
        for _ in range(self.batch_size):
            kind = "pretrain" if is_pretrain_row(self.rows, self.fraction) else "sft"
            row = self._pretrain_row() if kind == "pretrain" else self.conversations.next_row()
            self.labels[kind] += int((row["labels"] != IGNORE_INDEX).sum())
            rows.append(row)
            self.rows += 1
        return {key: torch.from_numpy(np.stack([r[key] for r in rows])) for key in rows[0]}

    def _pretrain_row(self) -> dict[str, np.ndarray]:
        batch = next(self.pretrain)  # [1, T]
        return {"input_ids": batch["input_ids"][0].numpy(), "labels": batch["labels"][0].numpy(),
                "segment_ids": np.zeros(self.seq_len, dtype=np.int64),
                "position_ids": np.arange(self.seq_len, dtype=np.int64)}

    def pretrain_rows(self) -> int:
        """Pre-training rows emitted so far."""
        return math.floor(self.rows * self.fraction)

    def state_dict(self) -> dict:
        """Stream position of both sources and the counters (JSON-serialisable)."""
        return {"version": STATE_VERSION, "fraction": self.fraction, "rows": self.rows, "labels": dict(self.labels),
                "conversations": self.conversations.state_dict(),
                "pretrain": self.pretrain.state_dict() if self.pretrain is not None else None}

    def load_state_dict(self, state: dict) -> None:
        """Resume from state_dict(); the data, seq_len, seed and fraction must be the same."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"unsupported SFT mixture loader state version {state.get('version')!r}")
        if state["fraction"] != self.fraction:
            raise ValueError(f"loader state was saved with pretrain_fraction {state['fraction']}, "
                             f"this run has {self.fraction}")
        self.conversations.load_state_dict(state["conversations"])
        if self.pretrain is not None:
            self.pretrain.load_state_dict(state["pretrain"])
        self.rows, self.labels = int(state["rows"]), dict(state["labels"])
