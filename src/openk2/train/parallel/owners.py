"""Which rank of a replication group orthogonalises which Muon matrix: owners balanced by Newton-Schulz FLOPs.

A unit is one 2-D matrix, or a contiguous run of rows (experts) of a 3-D [E, n, m] stack. Stacks are cut into
`group_size` near-equal row chunks, one per rank (rotated from stack to stack so the remainders spread);
2-D matrices then go, largest first, to the least-loaded rank (longest-processing-time greedy). Every rank
computes the same assignment from the same shapes: no communication, and the same owners on every step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Unit:
    """Rows [start, stop) of parameter `index` (the whole matrix for 2-D: start = stop = 0), owned by `owner`."""

    index: int
    start: int
    stop: int
    owner: int
    flops: int

    @property
    def is_rows(self) -> bool:
        return self.stop > self.start

    def view(self, tensor: torch.Tensor) -> torch.Tensor:
        """This unit's part of a tensor shaped like its parameter (a view)."""
        return tensor[self.start:self.stop] if self.is_rows else tensor


def newton_schulz_flops(shape: tuple[int, ...], steps: int) -> int:
    """Multiply-add FLOPs of `steps` quintic Newton-Schulz iterations on one [..., n, m] matrix (or stack).

    Per iteration, with s = min(n, m), b = max(n, m): A = X X^T (2 s^2 b), A (c A + b I) (2 s^3), P X (2 s^2 b).
    """
    n, m = shape[-2:]
    s, b = min(n, m), max(n, m)
    count = 1
    for d in shape[:-2]:
        count *= d
    return count * steps * (4 * s * s * b + 2 * s ** 3)


def _row_chunks(rows: int, parts: int) -> list[tuple[int, int]]:
    """`parts` contiguous [start, stop) chunks of `rows`, the first rows % parts one row longer."""
    base, extra = divmod(rows, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def assign_owners(shapes: list[tuple[int, ...]], group_size: int, steps: int = 5) -> list[Unit]:
    """The units of the Muon parameters of `shapes` (2-D or 3-D) and their owners in a group of `group_size`."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    load = [0] * group_size
    units: list[Unit] = []
    rotation = 0
    for index, shape in enumerate(shapes):
        if len(shape) != 3:
            continue
        per_row = newton_schulz_flops(shape[1:], steps)
        for chunk, (start, stop) in enumerate(_row_chunks(shape[0], group_size)):
            if stop == start:
                continue
            owner = (chunk + rotation) % group_size
            units.append(Unit(index, start, stop, owner, per_row * (stop - start)))
            load[owner] += per_row * (stop - start)
        rotation += shape[0] % group_size
    flat = [(newton_schulz_flops(shape, steps), index) for index, shape in enumerate(shapes) if len(shape) == 2]
    for flops, index in sorted(flat, key=lambda fi: (-fi[0], fi[1])):
        owner = min(range(group_size), key=lambda r: (load[r], r))
        units.append(Unit(index, 0, 0, owner, flops))
        load[owner] += flops
    return sorted(units, key=lambda u: (u.index, u.start))
