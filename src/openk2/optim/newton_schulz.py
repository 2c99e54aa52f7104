"""The quintic Newton-Schulz iteration in three kernels: native low-precision, emulated, and plain fp32.

All three take a [B, n, m] batch with n <= m and compute the same iteration, X <- a X + (b A + c A^2) X
with A = X X^T (the fp32 ones as P X with P = a I + A (c A + b I), so the elementwise work stays on the
small n x n side); they differ only in the dtype the products are computed and stored in:

- "native":   products in `dtype` kernels (bf16 GEMM units: GPUs, avx512_bf16 / AMX CPUs);
- "emulated": fp32 arithmetic, every product rounded to `dtype` (the same rounding points as native);
- "fp32":     fp32 throughout, no rounding (more precise than asked; fastest where bf16 GEMM is slow).

Which one is fastest depends on the machine, so `ns_kernel.select_ns_kernel` measures it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["NS_COEFFICIENTS", "NS_EPS", "NS_KERNELS", "newton_schulz"]

# Quintic coefficients from Keller Jordan's Muon; they maximise the slope at zero, so small singular
# values grow fast, at the price of the iteration oscillating around 1 instead of converging to it.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7


def _normalised(X: Tensor, dtype: torch.dtype, out: Tensor | None = None) -> Tensor:
    """X / (||X||_F + eps) per matrix, computed in fp32 and written straight into `dtype` (one rounding)."""
    norm = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True, dtype=torch.float32).add_(NS_EPS)
    if out is None:
        out = torch.empty(X.shape, dtype=dtype, device=X.device)
    return torch.div(X, norm, out=out)


def _polynomial(A: Tensor, T: Tensor, P: Tensor) -> Tensor:
    """P = a I + A (c A + b I) for a batch of Gram matrices A, using T as scratch; all three share a dtype."""
    a, b, c = NS_COEFFICIENTS
    torch.mul(A, c, out=T)
    T.diagonal(dim1=-2, dim2=-1).add_(b)
    torch.bmm(A, T, out=P)
    P.diagonal(dim1=-2, dim2=-1).add_(a)
    return P


def _ns_native(X: Tensor, steps: int, dtype: torch.dtype, overwrite: bool) -> Tensor:
    """Newton-Schulz with `dtype` kernels for every product, in torch.optim.Muon's form; returns `dtype`."""
    a, b, c = NS_COEFFICIENTS
    X = _normalised(X, dtype)
    batch, n, _ = X.shape
    Y = torch.empty_like(X)
    A, B = X.new_empty(batch, n, n), X.new_empty(batch, n, n)
    # Not the P X form: in `dtype`, rounding P = a I + A (c A + b I) step by step costs 3-7% relative error
    # against the fp64 iteration (measured; 1.2-1.6% for this form, as for torch's), while the baddbmm form
    # accumulates each sum inside the GEMM and rounds once. Preallocated out= buffers avoid allocations.
    for _ in range(steps):
        torch.bmm(X, X.mT, out=A)
        torch.baddbmm(A, A, A, beta=b, alpha=c, out=B)
        torch.baddbmm(X, B, X, beta=a, out=Y)
        X, Y = Y, X
    return X


def _ns_emulated(X: Tensor, steps: int, dtype: torch.dtype, overwrite: bool) -> Tensor:
    """Newton-Schulz in fp32 arithmetic that rounds every product to `dtype`, as native kernels store it."""
    X_low = _normalised(X, dtype)
    reuse = overwrite and X.dtype == torch.float32 and X.is_contiguous()
    work = X if reuse else torch.empty(X.shape, dtype=torch.float32, device=X.device)
    X = work.copy_(X_low)
    batch, n, _ = X.shape
    Y = torch.empty_like(X)
    A, T, P = (X.new_empty(batch, n, n) for _ in range(3))
    small_low = torch.empty(A.shape, dtype=dtype, device=X.device)
    for _ in range(steps):
        torch.bmm(X, X.mT, out=A)
        A.copy_(small_low.copy_(A))
        P = _polynomial(A, T, P)
        P.copy_(small_low.copy_(P))
        torch.bmm(P, X, out=Y)
        Y.copy_(X_low.copy_(Y))
        X, Y = Y, X
    return X


def _ns_fp32(X: Tensor, steps: int, dtype: torch.dtype, overwrite: bool) -> Tensor:
    """Newton-Schulz in fp32 throughout (`dtype` is ignored); returns fp32."""
    reuse = overwrite and X.dtype == torch.float32 and X.is_contiguous()
    X = _normalised(X, torch.float32, out=X if reuse else None)
    batch, n, _ = X.shape
    Y = torch.empty_like(X)
    A, T, P = (X.new_empty(batch, n, n) for _ in range(3))
    for _ in range(steps):
        torch.bmm(X, X.mT, out=A)
        torch.bmm(_polynomial(A, T, P), X, out=Y)
        X, Y = Y, X
    return X


NS_KERNELS: dict[str, Callable[[Tensor, int, torch.dtype, bool], Tensor]] = {
    "native": _ns_native,
    "emulated": _ns_emulated,
    "fp32": _ns_fp32,
}


def newton_schulz(X: Tensor, steps: int, dtype: torch.dtype, kernel: str, *, overwrite: bool = False) -> Tensor:
    """Orthogonalise each matrix of a [B, n, m] batch (n <= m) with the named kernel.

    The result is `dtype` for "native" and fp32 otherwise; overwrite=True lets an fp32 X serve as scratch.
    """
    if kernel not in NS_KERNELS:
        raise ValueError(f"unknown Newton-Schulz kernel {kernel!r}; valid: {', '.join(NS_KERNELS)}")
    return NS_KERNELS[kernel](X, steps, dtype, overwrite)
