"""A safe evaluator for + - * / arithmetic on integers, exact (Fractions): no `eval`, no names, no calls."""

from __future__ import annotations

import ast
import operator
from fractions import Fraction

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_MAX_LEN = 200  # an answer longer than this is not a small arithmetic expression; refuse before parsing


def evaluate(expression: str) -> tuple[Fraction, list[int]]:
    """The exact value of `expression` and the integer literals it uses, in order.

    Raises ValueError on anything but integer literals, + - * /, unary minus and parentheses, and on
    division by zero.

    >>> evaluate("(8 - 2) * 4")
    (Fraction(24, 1), [8, 2, 4])
    """
    text = expression.strip().replace("×", "*").replace("÷", "/").replace("−", "-")
    if not text or len(text) > _MAX_LEN:
        raise ValueError("empty or overlong expression")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from e
    numbers: list[int] = []
    return _eval(tree.body, numbers), numbers


def _eval(node: ast.AST, numbers: list[int]) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        numbers.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval(node.operand, numbers)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left, numbers), _eval(node.right, numbers)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ValueError("division by zero")
        return _BINARY[type(node.op)](left, right)
    raise ValueError(f"unsupported syntax in arithmetic expression: {type(node).__name__}")
