"""Generated math text: column arithmetic with worked carries, long division and word problems.

Every `X = Y` written in a document, with X made only of integers, `+`, `-`, `*` and parentheses, is
arithmetically true (the tests check this); division is written as `dividend = divisor * q + r`.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator

PLACES = ("ones", "tens", "hundreds", "thousands", "ten-thousands", "hundred-thousands", "millions")
NAMES = ("Ada", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hugo", "Iris", "Jon", "Kemi", "Liam")
ITEMS = ("apples", "marbles", "stamps", "pencils", "cards", "shells", "books", "coins")


def math_documents(seed: int = 0, count: int | None = None) -> Iterator[str]:
    """Deterministic stream of math documents; infinite when `count` is None."""
    indices = itertools.count() if count is None else range(count)
    for i in indices:
        yield math_document(seed, i)


def math_document(seed: int, index: int) -> str:
    """The `index`-th document for `seed` (each one independent, so any slice is cheap to regenerate)."""
    rng = random.Random(f"openk2-math:{seed}:{index}")
    make: Callable[[random.Random], str] = rng.choice(GENERATORS)
    return make(rng)


def _number(rng: random.Random, lo_digits: int, hi_digits: int) -> int:
    digits = rng.randint(lo_digits, hi_digits)
    return rng.randint(10 ** (digits - 1), 10**digits - 1)


def _digits(n: int, width: int) -> list[int]:
    # Least significant digit first, zero-padded to `width`.
    return [(n // 10**i) % 10 for i in range(width)]


def addition(rng: random.Random) -> str:
    """Column addition, one line per place with its carry."""
    a, b = _number(rng, 2, 6), _number(rng, 1, 6)
    width = len(str(max(a, b)))
    lines = [f"Problem: {a} + {b} = ?", "Add the columns from the right, carrying the tens."]
    carry = 0
    for place, da, db in zip(PLACES, _digits(a, width), _digits(b, width), strict=False):
        total = da + db + carry
        terms = f"{da} + {db}" + (f" + {carry}" if carry else "")
        carry = total // 10
        lines.append(f"{place}: {terms} = {total}, write {total % 10}, carry {carry}")
    if carry:
        lines.append(f"The last carry {carry} becomes the leading digit.")
    lines.append(f"Answer: {a} + {b} = {a + b}")
    return "\n".join(lines) + "\n"


def subtraction(rng: random.Random) -> str:
    """Column subtraction with borrows (larger number first)."""
    a, b = sorted((_number(rng, 2, 6), _number(rng, 1, 6)), reverse=True)
    width = len(str(a))
    lines = [f"Problem: {a} - {b} = ?", "Subtract the columns from the right, borrowing when needed."]
    borrow = 0
    for place, da, db in zip(PLACES, _digits(a, width), _digits(b, width), strict=False):
        top = f"{da} - {borrow}" if borrow else f"{da}"
        if da - borrow >= db:
            lines.append(f"{place}: {top} - {db} = {da - borrow - db}")
            borrow = 0
        else:
            lines.append(
                f"{place}: {top} is less than {db}, so borrow ten: 10 + {top} - {db} = "
                f"{10 + da - borrow - db}"
            )
            borrow = 1
    lines.append(f"Answer: {a} - {b} = {a - b}")
    return "\n".join(lines) + "\n"


def multiplication(rng: random.Random) -> str:
    """Long multiplication by partial products."""
    a, b = _number(rng, 2, 4), _number(rng, 1, 3)
    lines = [f"Problem: {a} * {b} = ?", f"Multiply {a} by each digit of {b}, shifted to its place."]
    partials = []
    for i, d in enumerate(_digits(b, len(str(b)))):
        if d:
            partials.append(a * d * 10**i)
            lines.append(f"{a} * {d * 10**i} = {partials[-1]}")
    if len(partials) > 1:
        lines.append(f"Add the partial products: {' + '.join(map(str, partials))} = {sum(partials)}")
    lines.append(f"Answer: {a} * {b} = {a * b}")
    return "\n".join(lines) + "\n"


def division(rng: random.Random) -> str:
    """Long division with remainder, bringing down one digit at a time."""
    d, n = rng.randint(2, 19), _number(rng, 2, 5)
    lines = [f"Problem: divide {n} by {d}.", "Work left to right, bringing down one digit at a time."]
    rest = 0
    for i, ch in enumerate(str(n)):
        cur = rest * 10 + int(ch)
        q, rest = divmod(cur, d)
        prefix = "start with" if i == 0 else "bring down " + ch + " to get"
        lines.append(f"{prefix} {cur}: {cur} = {d} * {q} + {rest}")
    q, r = divmod(n, d)
    lines.append(f"Answer: {n} = {d} * {q} + {r}, so the quotient is {q} and the remainder is {r}")
    return "\n".join(lines) + "\n"


def word_problem(rng: random.Random) -> str:
    """A short word problem with a worked solution."""
    name, other = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    kind = rng.randrange(4)
    if kind == 0:
        a, packs, per = rng.randint(2, 60), rng.randint(2, 9), rng.randint(2, 12)
        q = (
            f"{name} has {a} {item}. {name} buys {packs} packs with {per} {item} in each pack. "
            f"How many {item} does {name} have now?"
        )
        steps = [
            f"The packs hold {packs} * {per} = {packs * per} {item}.",
            f"Together: {a} + {packs * per} = {a + packs * per}.",
        ]
        ans = a + packs * per
    elif kind == 1:
        boxes, each, given = rng.randint(2, 9), rng.randint(2, 15), rng.randint(1, 30)
        total = boxes * each + given
        q = (
            f"{name} had {total} {item} and gave {given} to {other}. {name} shares the rest equally "
            f"among {boxes} boxes. How many {item} go in each box?"
        )
        steps = [
            f"After giving some away: {total} - {given} = {total - given}.",
            f"Sharing among {boxes} boxes: {total - given} = {boxes} * {each} + 0.",
        ]
        ans = each
    elif kind == 2:
        speed, hours = rng.randint(20, 250), rng.randint(2, 12)
        q = f"A train travels at {speed} km per hour for {hours} hours. How far does it go?"
        steps = [f"Distance is speed times time: {speed} * {hours} = {speed * hours} km."]
        ans = speed * hours
    else:
        w, h = rng.randint(2, 150), rng.randint(2, 150)
        q = f"A garden is {w} m wide and {h} m long. What is its perimeter?"
        steps = [f"Two widths and two lengths: 2 * ({w} + {h}) = {2 * (w + h)} m."]
        ans = 2 * (w + h)
    return "\n".join([f"Problem: {q}", "Solution:", *steps, f"Answer: {ans}"]) + "\n"


GENERATORS: tuple[Callable[[random.Random], str], ...] = (
    addition,
    subtraction,
    multiplication,
    division,
    word_problem,
)
