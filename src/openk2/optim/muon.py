"""Muon optimizer in the Moonlight / Kimi K2 form, with batched Newton-Schulz orthogonalisation."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from openk2.optim.newton_schulz import NS_COEFFICIENTS, NS_KERNELS, newton_schulz
from openk2.optim.ns_kernel import select_ns_kernel

__all__ = ["NS_COEFFICIENTS", "Muon", "apply_muon_update", "muon_momentum", "zeropower_via_newtonschulz5"]

ParamsT = Iterable[Tensor] | Iterable[dict[str, Any]]


def _kernel_name(kernel: str | None, emulate: bool | None, device: torch.device, dtype: torch.dtype) -> str:
    """Resolve the Newton-Schulz kernel: an explicit name, the legacy emulate flag, else the measured choice."""
    if kernel is not None and emulate is not None:
        raise ValueError("give either ns_kernel or ns_emulate, not both")
    if kernel is None and emulate is not None:
        kernel = "emulated" if emulate else "native"
    if kernel is None or kernel == "auto":
        return select_ns_kernel(device, dtype)
    if kernel not in NS_KERNELS:
        raise ValueError(f"unknown Newton-Schulz kernel {kernel!r}; valid: auto, {', '.join(NS_KERNELS)}")
    return kernel


def zeropower_via_newtonschulz5(
    X: Tensor,
    steps: int = 5,
    dtype: torch.dtype = torch.bfloat16,
    *,
    emulate: bool | None = None,
    kernel: str | None = None,
) -> Tensor:
    """Approximate U V^T of X = U S V^T (per matrix for a 3-D batch) with quintic Newton-Schulz.

    kernel: "native", "emulated", "fp32" or None/"auto" (measured per process, see ns_kernel.py);
    emulate=True/False is the older spelling of "emulated"/"native". The result has `dtype`.
    """
    if X.ndim not in (2, 3):
        raise ValueError(f"expected a matrix or a [B, n, m] batch of matrices, got shape {tuple(X.shape)}")
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    name = _kernel_name(kernel, emulate, X.device, dtype)
    batch = X if X.ndim == 3 else X.unsqueeze(0)
    # Iterate on the wide orientation so the Gram matrix X X^T is the small side.
    tall = X.size(-2) > X.size(-1)
    out = newton_schulz(batch.mT if tall else batch, steps, dtype, name).to(dtype)
    if tall:
        out = out.mT
    return out if X.ndim == 3 else out[0]


def _check_group(group: dict[str, Any]) -> None:
    """Reject hyperparameters and parameter shapes Muon cannot handle."""
    if not group["lr"] >= 0.0:
        raise ValueError(f"lr must be >= 0, got {group['lr']}")
    if not 0.0 <= group["momentum"] < 1.0:
        raise ValueError(f"momentum must be in [0, 1), got {group['momentum']}")
    if not group["weight_decay"] >= 0.0:
        raise ValueError(f"weight_decay must be >= 0, got {group['weight_decay']}")
    if not group["rms_scale"] > 0.0:
        raise ValueError(f"rms_scale must be > 0, got {group['rms_scale']}")
    if not isinstance(group["ns_steps"], int) or group["ns_steps"] < 1:
        raise ValueError(f"ns_steps must be a positive int, got {group['ns_steps']}")
    if not isinstance(group["ns_dtype"], torch.dtype) or not group["ns_dtype"].is_floating_point:
        raise ValueError(f"ns_dtype must be a floating torch.dtype, got {group['ns_dtype']}")
    kernel = group.get("ns_kernel")
    if kernel is not None and group.get("ns_emulate") is not None:
        raise ValueError("give either ns_kernel or ns_emulate, not both")
    if kernel not in (None, "auto", *NS_KERNELS):
        raise ValueError(f"unknown ns_kernel {kernel!r}; valid: auto, {', '.join(NS_KERNELS)}")
    for p in group["params"]:
        if p.ndim not in (2, 3):
            raise ValueError(
                f"Muon takes 2-D matrices and 3-D [E, n, m] expert stacks, got a parameter of shape "
                f"{tuple(p.shape)}; give 1-D parameters (norms, biases) and embeddings to AdamW"
            )
        if p.is_complex():
            raise ValueError("Muon does not support complex parameters")


class Muon(torch.optim.Optimizer):
    """Muon (momentum orthogonalised by Newton-Schulz) with the Moonlight RMS-matching update scale."""

    def __init__(
        self,
        params: ParamsT,
        lr: float,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.1,
        ns_steps: int = 5,
        rms_scale: float = 0.2,
        ns_dtype: torch.dtype = torch.bfloat16,
        *,
        ns_emulate: bool | None = None,
        ns_kernel: str | None = None,
    ) -> None:
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "nesterov": nesterov,
            "weight_decay": weight_decay,
            "ns_steps": ns_steps,
            "rms_scale": rms_scale,
            "ns_dtype": ns_dtype,
            "ns_emulate": ns_emulate,
            "ns_kernel": ns_kernel,
        }
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group after checking its shapes and hyperparameters."""
        super().add_param_group(param_group)
        try:
            _check_group(self.param_groups[-1])
        except ValueError:
            self.param_groups.pop()
            raise

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load state, keeping momentum buffers in fp32 even for low-precision parameters."""
        saved_bufs = {k: v.get("momentum_buffer") for k, v in state_dict["state"].items()}
        super().load_state_dict(state_dict)
        # The base class casts floating state to the parameter dtype, which would round the fp32
        # momentum of bf16 parameters; put the saved fp32 buffers back.
        saved_ids = (i for g in state_dict["param_groups"] for i in g["params"])
        params = (p for g in self.param_groups for p in g["params"])
        for saved_id, p in zip(saved_ids, params, strict=True):
            buf = saved_bufs.get(saved_id)
            if buf is not None and p.dtype != torch.float32:
                self.state[p]["momentum_buffer"] = buf.to(device=p.device, dtype=torch.float32, copy=True)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one optimisation step."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._step_group(group)
        return loss

    def _step_group(self, group: dict[str, Any]) -> None:
        """Update every parameter of one group, batching Newton-Schulz over same-shaped matrices."""
        params: list[Tensor] = []
        grads: list[Tensor] = []
        bufs: list[Tensor] = []
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise ValueError("Muon does not support sparse gradients")
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(
                    p, dtype=torch.float32, memory_format=torch.contiguous_format
                )
            params.append(p)
            grads.append(p.grad.float())
            bufs.append(state["momentum_buffer"])
        if not params:
            return

        # One Newton-Schulz batch per (device, small side, large side): tall matrices are transposed
        # in, so e.g. experts' down_proj [E, H, I] joins gate/up [E, I, H] in the same batch.
        buckets: dict[tuple[torch.device, int, int], list[int]] = defaultdict(list)
        for i, p in enumerate(params):
            n, m = p.shape[-2:]
            buckets[(p.device, min(n, m), max(n, m))].append(i)

        ns_dtype = group["ns_dtype"]
        for (device, small, big), idx in buckets.items():
            kernel = _kernel_name(group.get("ns_kernel"), group.get("ns_emulate"), device, ns_dtype)
            members = [params[i] for i in idx]
            stacked = torch.empty(_batch_size(members), small, big, dtype=torch.float32, device=device)
            # The momentum directions are written straight into the batch: no per-matrix temporaries.
            muon_momentum([bufs[i] for i in idx], [grads[i] for i in idx], group["momentum"],
                          nesterov=group["nesterov"], out=_param_views(stacked, members))
            # The native kernel's bf16 result goes into the fp32 update as is: no fp32 copy of the batch.
            ortho = newton_schulz(stacked, group["ns_steps"], ns_dtype, kernel, overwrite=True)
            apply_muon_update(members, _param_views(ortho, members), lr=group["lr"],
                              weight_decay=group["weight_decay"], rms_scale=group["rms_scale"], shape=(small, big))


def _batch_size(params: list[Tensor]) -> int:
    """Number of matrices in a list of matrices and [E, n, m] stacks."""
    return sum(p.size(0) if p.ndim == 3 else 1 for p in params)


def _param_views(batch: Tensor, params: list[Tensor]) -> list[Tensor]:
    """Views into a [B, small, large] batch shaped like each parameter (tall ones transposed back)."""
    out = []
    offset = 0
    for p in params:
        count = p.size(0) if p.ndim == 3 else 1
        piece = batch[offset : offset + count]
        offset += count
        if p.size(-2) > p.size(-1):
            piece = piece.mT
        out.append(piece if p.ndim == 3 else piece[0])
    return out


def muon_momentum(
    bufs: list[Tensor],
    grads: list[Tensor],
    momentum: float,
    *,
    nesterov: bool = True,
    out: list[Tensor] | None = None,
) -> list[Tensor]:
    """Muon's momentum step: M <- mu M + G in place; returns what to orthogonalise, G + mu M or (nesterov=False) M.

    `bufs` and `grads` pair up tensor for tensor (any shape, fp32); the directions are written into `out`
    (e.g. views of a Newton-Schulz batch) when given, else into fresh tensors. The buffers keep mu M + G.
    """
    torch._foreach_mul_(bufs, momentum)
    torch._foreach_add_(bufs, grads)
    if out is None:
        out = [torch.empty_like(buf) for buf in bufs]
    for direction, grad, buf in zip(out, grads, bufs, strict=True):
        if nesterov:
            torch.add(grad, buf, alpha=momentum, out=direction)
        else:
            direction.copy_(buf)
    return out


def apply_muon_update(
    params: list[Tensor],
    orthos: list[Tensor],
    *,
    lr: float,
    weight_decay: float,
    rms_scale: float,
    shape: tuple[int, ...],
) -> None:
    """W <- (1 - lr wd) W - lr * rms_scale * sqrt(max(n, m)) * O for every (W, O) pair, in place.

    `orthos` are the Newton-Schulz outputs (fp32 or ns_dtype) for matrices of `shape` (..., n, m); a W may be a whole
    parameter or any piece of one (a ZeRO slice) as long as its O is the matching piece. Decoupled weight
    decay; the sqrt(max(n, m)) * rms_scale factor turns the ~unit-singular-value O (RMS 1/sqrt(max)) into an
    update with RMS ~rms_scale, matching AdamW's typical update RMS (Moonlight, arXiv:2502.16982). Low-precision
    W are updated in fp32 and rounded once.
    """
    decay = 1.0 - lr * weight_decay
    alpha = -lr * rms_scale * math.sqrt(max(shape[-2:]))
    wide = (torch.float32, torch.float64)
    in_place = [i for i, p in enumerate(params) if p.dtype in wide]
    low = [i for i, p in enumerate(params) if p.dtype not in wide]
    if in_place:
        targets = [params[i] for i in in_place]
        if decay != 1.0:
            torch._foreach_mul_(targets, decay)
        torch._foreach_add_(targets, [orthos[i] for i in in_place], alpha=alpha)
    if low:
        work = [params[i].float() for i in low]
        if decay != 1.0:
            torch._foreach_mul_(work, decay)
        torch._foreach_add_(work, [orthos[i] for i in low], alpha=alpha)
        torch._foreach_copy_([params[i] for i in low], work)
