"""Sudoku: fill a 9x9 grid so every row, column and 3x3 box holds 1-9 once, keeping the given digits.

`data` is `{"puzzle": 81 characters, digits and '.' for blanks}` (row-major). The answer is the 81 digits of
the solved grid, on one line or as nine rows (whitespace and separators are ignored). Any valid completion
of the givens scores 1.0, so puzzles need not have a unique solution. Difficulty = number of blanks.
"""

from __future__ import annotations

import random
import re

from openk2.rl.tasks.base import Problem, Task, extract_answer

_BLANKS = {1: 20, 2: 30, 3: 40, 4: 48, 5: 55}
_UNITS = ([[r * 9 + c for c in range(9)] for r in range(9)]
          + [[r * 9 + c for r in range(9)] for c in range(9)]
          + [[(br + r) * 9 + bc + c for r in range(3) for c in range(3)] for br in (0, 3, 6) for bc in (0, 3, 6)])
_PEERS = [sorted({j for unit in _UNITS if i in unit for j in unit} - {i}) for i in range(81)]


class SudokuTask(Task):
    name = "sudoku"
    num_difficulties = len(_BLANKS)
    max_tokens = 4096

    def generate(self, seed: int, difficulty: int = 1) -> Problem:
        difficulty = self._check_difficulty(difficulty)
        rng = random.Random(f"{self.name}:{seed}:{difficulty}")
        grid = _random_solved_grid(rng)
        for i in rng.sample(range(81), _BLANKS[difficulty]):
            grid[i] = "."
        puzzle = "".join(grid)
        rows = "\n".join(" ".join(puzzle[r * 9:r * 9 + 9]) for r in range(9))
        prompt = ("Solve this Sudoku ('.' marks a blank). Every row, column and 3x3 box must contain the digits "
                  f"1-9 exactly once.\n{rows}\nGive the solved grid as 81 digits, row by row.")
        return self._problem(prompt, {"puzzle": puzzle}, seed, difficulty)

    def verify(self, problem: Problem, response_text: str) -> float:
        answer = extract_answer(response_text, multiline=True)
        if answer is None:
            return 0.0
        digits = re.findall(r"[1-9]", answer)
        if len(digits) != 81:
            return 0.0
        puzzle = problem.data["puzzle"]
        keeps_givens = all(p == "." or p == d for p, d in zip(puzzle, digits, strict=True))
        return float(keeps_givens and is_solved("".join(digits)))


def is_solved(grid: str) -> bool:
    """Whether the 81-character `grid` is a complete, valid Sudoku solution."""
    return len(grid) == 81 and all(sorted(grid[i] for i in unit) == list("123456789") for unit in _UNITS)


def solve_sudoku(puzzle: str) -> str | None:
    """A completion of `puzzle` ('.' for blanks), or None if it has none (backtracking, fewest candidates first)."""
    if len(puzzle) != 81 or not set(puzzle) <= set("123456789."):
        raise ValueError("a Sudoku puzzle is 81 characters of digits 1-9 and '.'")
    grid = list(puzzle)
    if any(grid[i] != "." and grid[i] in {grid[j] for j in _PEERS[i]} for i in range(81)):
        return None  # two equal givens share a unit; search would never notice
    blanks = [i for i in range(81) if grid[i] == "."]

    def candidates(i: int) -> set[str]:
        return set("123456789") - {grid[j] for j in _PEERS[i]}

    def search() -> bool:
        open_cells = [i for i in blanks if grid[i] == "."]
        if not open_cells:
            return True
        cell = min(open_cells, key=lambda i: len(candidates(i)))
        for digit in sorted(candidates(cell)):
            grid[cell] = digit
            if search():
                return True
        grid[cell] = "."
        return False

    return "".join(grid) if search() else None


def _random_solved_grid(rng: random.Random) -> list[str]:
    """A random valid grid: a fixed pattern with rows, columns, bands, stacks and digit labels shuffled."""
    def shuffled_axis() -> list[int]:
        bands = rng.sample(range(3), 3)
        return [band * 3 + r for band in bands for r in rng.sample(range(3), 3)]

    rows, cols, labels = shuffled_axis(), shuffled_axis(), rng.sample("123456789", 9)
    return [labels[(3 * (r % 3) + r // 3 + c) % 9] for r in rows for c in cols]
