"""Tests for the generated math text: deterministic and arithmetically correct."""

import ast
import operator
import re

from openk2.data.mathgen import math_document, math_documents

# Integer expressions (digits, + - *, parentheses) on both sides of " = ".
EQUATION = re.compile(r"(\d[\d +\-*()]*?) = (\d[\d +\-*()]*\d|\d)")
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def evaluate(expr: str) -> int:
    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](walk(node.left), walk(node.right))
        raise ValueError(f"not an integer expression: {expr!r}")

    return walk(ast.parse(expr, mode="eval"))


def test_deterministic():
    assert list(math_documents(3, 50)) == list(math_documents(3, 50))
    assert list(math_documents(3, 50)) != list(math_documents(4, 50))
    assert math_document(3, 17) == list(math_documents(3, 18))[17]


def test_infinite_stream():
    stream = math_documents(0)
    assert [next(stream) for _ in range(5)] == list(math_documents(0, 5))


def test_all_kinds_present():
    docs = list(math_documents(0, 400))
    text = "\n".join(docs)
    for needle in (" + ", " - ", " * ", "divide", "carry", "borrow", "Solution:", "remainder"):
        assert needle in text
    assert all(d.rstrip().splitlines()[-1].startswith("Answer: ") for d in docs)


def test_every_equation_is_true():
    checked = 0
    for doc in math_documents(7, 2000):
        for line in doc.splitlines():
            for m in EQUATION.finditer(line):
                assert evaluate(m.group(1)) == evaluate(m.group(2)), line
                checked += 1
    assert checked > 8000


def test_final_answers():
    seen = set()
    for doc in math_documents(1, 1000):
        last = doc.rstrip().splitlines()[-1]
        if m := re.fullmatch(r"Answer: (\d+) ([+\-*]) (\d+) = (\d+)", last):
            a, op, b, c = m.groups()
            assert evaluate(f"{a} {op} {b}") == int(c)
            seen.add(op)
        elif m := re.fullmatch(r"Answer: (\d+) = (\d+) \* (\d+) \+ (\d+), .*", last):
            n, d, q, r = map(int, m.groups())
            assert n == d * q + r and 0 <= r < d
            seen.add("/")
    assert seen == {"+", "-", "*", "/"}
