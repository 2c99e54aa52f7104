"""Activation-memory options for training (K2 report, "Activation Reduction"), applied from outside the model.

Three independent switches, set in a run's `[memory]` table and applied by `apply_memory_options(model, cfg)`:

* `recompute`: "full" checkpoints every decoder layer (only its input is kept). "selective" checkpoints every
  layer with a selective-checkpoint policy that keeps the outputs of the expensive ops (matmuls, attention)
  and recomputes the cheap, memory-heavy ones the report names: norms and every other elementwise op (SwiGLU,
  rope, casts), the MLA up-projections (`q_b_proj`, `kv_b_proj`) and the down-projections of SwiGLU blocks
  (dense MLP, shared and routed experts).
* `fp8_activations`: inside SwiGLU blocks (routed experts, shared experts, dense MLPs) the report's set of saved
  activations -- the block input (what the up/gate projections read) and the SwiGLU inputs (the gate and up
  projection outputs) -- is stored as float8_e4m3fn in 1x128 tiles along the last dim with one fp32 scale per
  tile (amax / 448), via saved-tensor hooks; compute stays in the model's dtype. A tensor saved by several ops
  (the block input, which the gate and the up matmul both save) is quantised once and both unpacks read that copy.
  The block's other saves (silu(gate), the product the down-projection reads) are handed on to the enclosing
  hooks unchanged.
* `cpu_offload`: every remaining activation saved for backward (not a weight, not FP8 tiles) is copied to host
  memory during the forward and copied back when backward needs it. That includes tensors without autograd
  history that an autograd.Function computes and saves inside its forward (RMSNorm's normalised input, the
  loss's log-sum-exp, short attention's probabilities) and the RoPE tables; the model's parameters and buffers
  stay. On CUDA the copy goes to pinned memory on a side stream, overlapping the forward's compute; on CPU the
  same mechanism runs (a host copy per tensor), which costs time and saves nothing, so it is only exercised and
  measured there.

How they compose: recompute regions are torch.utils.checkpoint (non-reentrant) regions. The FP8 hooks are
pushed inside them and pass what they do not quantise on to the checkpoint's hooks, so with selective
recompute a SwiGLU block keeps only the FP8 tiles and recomputes silu(gate), the product and the
down-projection; its matmul outputs are then not cached at full precision either (that would undo FP8), so
backward recomputes the gate/up projections too where it needs the product. Offload hooks wrap the whole
forward and see what the inner mechanisms leave: the checkpointed layers' inputs and everything saved outside
checkpointed regions (FP8 tiles stay on the device).

Recomputing a layer replays its forward; statistics are recorded once all the same, because the caller's
`ForwardStats` collector is handed to the first call of a checkpointed layer only (its replay records into an
empty one that is dropped).
"""

from __future__ import annotations

import ctypes
import functools
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from openk2.model.attention import MLAttention
from openk2.model.layers import MLP
from openk2.model.moe import RoutedExperts
from openk2.model.stats import ForwardStats
from openk2.model.transformer import DecoderLayer

RECOMPUTE_MODES = ("none", "selective", "full")
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_TILE = 128  # report: "1 x 128 tiles with FP32 scales"

aten = torch.ops.aten
# Ops whose outputs selective recompute keeps: the FLOP-heavy ones (matmuls, attention kernels).
_EXPENSIVE_OPS = {
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten._grouped_mm.default,
    aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default, aten._scaled_dot_product_flash_attention_for_cpu.default,
}


@dataclass(kw_only=True)
class MemorySection:
    """The `[memory]` table of a run config."""

    recompute: str = "none"  # "none" | "selective" (norms, SwiGLU, MLA up-proj, down-proj) | "full" (per layer)
    fp8_activations: bool = False  # SwiGLU-block activations saved as FP8-E4M3, 1x128 tiles, fp32 scales
    cpu_offload: bool = False  # the remaining saved activations go to host memory (pinned, side stream on CUDA)
    offload_min_bytes: int = 1 << 14  # smaller saved tensors stay where they are (not worth a copy)

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"memory.recompute must be one of {RECOMPUTE_MODES}, got {self.recompute!r}")
        for name in ("fp8_activations", "cpu_offload"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"memory.{name} must be true or false, got {getattr(self, name)!r}")
        if isinstance(self.offload_min_bytes, bool) or not isinstance(self.offload_min_bytes, int) \
                or self.offload_min_bytes < 0:
            raise ValueError(f"memory.offload_min_bytes must be a non-negative integer, got {self.offload_min_bytes!r}")
        if self.fp8_activations and self.recompute == "full":
            warnings.warn("memory.fp8_activations does nothing with memory.recompute = 'full' (a layer saves "
                          "nothing to compress: backward recomputes it from the layer input); it is ignored",
                          stacklevel=2)

    @property
    def enabled(self) -> bool:
        return self.recompute != "none" or self.fp8_activations or self.cpu_offload

    @property
    def fp8_saves(self) -> bool:
        """Whether SwiGLU saves go to FP8: not under full recompute, where the FP8 hooks would sit inside the
        checkpoint, keep the forward's tiles that the checkpoint would have dropped, and quantise the replay's
        again (full + fp8 held 923 kB against 535 kB for full alone on the test model)."""
        return self.fp8_activations and self.recompute != "full"


# ---------------------------------------------------------------------------------------------- FP8 tiles
@dataclass
class Fp8Tiles:
    """A tensor stored as float8_e4m3fn tiles of FP8_TILE along its last dim, one fp32 scale per tile."""

    data: torch.Tensor  # [..., num_tiles, FP8_TILE] float8_e4m3fn (last dim zero-padded to a tile multiple)
    scales: torch.Tensor  # [..., num_tiles, 1] fp32
    last_dim: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scales.nbytes


def quantize_fp8(x: torch.Tensor) -> Fp8Tiles:
    """Quantise x per 1x128 tile of its last dim: scale = tile amax / 448, values rounded to float8_e4m3fn."""
    last = x.shape[-1]
    x32 = x.float()
    if last % FP8_TILE:
        x32 = torch.nn.functional.pad(x32, (0, FP8_TILE - last % FP8_TILE))
    tiles = x32.reshape(*x.shape[:-1], -1, FP8_TILE)
    scales = (tiles.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    data = (tiles / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return Fp8Tiles(data, scales, last, x.dtype)


def dequantize_fp8(q: Fp8Tiles) -> torch.Tensor:
    """The tensor `quantize_fp8` stored, back in its original dtype and shape."""
    x32 = (q.data.float() * q.scales).flatten(-2)[..., :q.last_dim]
    return x32.to(q.dtype)


# ---------------------------------------------------------------------------------------------- regions
@dataclass
class _Region:
    """A stretch of the forward that the memory options treat specially (a SwiGLU block, an up-projection)."""

    kind: str  # "swiglu" | "up_proj"
    input_storage: int = 0  # storage pointer of a SwiGLU block's input: matmuls reading it are gate/up

    def reads_input(self, x: torch.Tensor) -> bool:
        return isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr() == self.input_storage


_state = threading.local()  # recomputation may run on autograd's device threads: one region stack per thread


def _regions() -> list[_Region]:
    if not hasattr(_state, "regions"):
        _state.regions = []
    return _state.regions


@contextmanager
def _in_region(region: _Region) -> Iterator[None]:
    stack = _regions()
    stack.append(region)
    try:
        yield
    finally:
        stack.pop()


def _selective_policy(fp8: bool, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Keep expensive op outputs, except in the regions the report recomputes; recompute every cheap op."""
    if op not in _EXPENSIVE_OPS or not torch.is_grad_enabled():  # no_grad work (the logit probe): never kept
        return CheckpointPolicy.PREFER_RECOMPUTE
    region = _regions()[-1] if _regions() else None
    if region is None:
        return CheckpointPolicy.MUST_SAVE
    if region.kind == "up_proj":
        return CheckpointPolicy.PREFER_RECOMPUTE
    # SwiGLU block: the gate/up matmuls read the block input and are kept; the down-projection is recomputed.
    # With FP8 the block's saves live in FP8 tiles, so a full-precision copy in the cache would waste memory.
    if fp8 or not region.reads_input(args[0]):
        return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE


# ---------------------------------------------------------------------------------------------- saved tensors
_WEIGHT_VIEWS = {"TransposeBackward0", "TBackward0", "ToCopyBackward0", "ViewBackward0", "PermuteBackward0",
                 "ExpandBackward0", "UnsafeViewBackward0", "AliasBackward0", "SliceBackward0", "SelectBackward0"}


def is_activation(t: torch.Tensor) -> bool:
    """True for a computed activation; False for parameters, their views and casts, and constants."""
    node = t.grad_fn
    if node is None:
        return False
    while type(node).__name__ in _WEIGHT_VIEWS:
        node = node.next_functions[0][0] if node.next_functions else None
        if node is None:
            return False
    return type(node).__name__ != "AccumulateGrad"


_VIEWS = {"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "TransposeBackward0", "TBackward0",
          "CatBackward0"}  # cat: the per-expert fallback of grouped_linear concatenates one mm per expert
_MATMULS = {"MmBackward0", "AddmmBackward0", "BmmBackward0", "GroupedMmBackward0"}


def _is_matmul_output(t: torch.Tensor) -> bool:
    node = t.grad_fn
    while node is not None and type(node).__name__ in _VIEWS:
        node = node.next_functions[0][0] if node.next_functions else None
    return node is not None and type(node).__name__ in _MATMULS


@dataclass
class _Delegated:
    """A saved tensor handed on to the hooks that were active outside the FP8 region (checkpoint, offload)."""

    packed: object
    unpack: Callable


def _saved_key(t: torch.Tensor) -> tuple:
    """What makes two saved tensors the same values: one storage, offset, shape, strides, dtype and version
    (gate and up each save their own view of the block input; an in-place write bumps the version)."""
    storage = t.untyped_storage()
    return storage.data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype, t._version


class _SaveOnce:
    """Packed values keyed by `_saved_key`, for one block's forward: a repeated save gets the first one back."""

    def __init__(self) -> None:
        self._seen: dict[tuple, tuple[object, StorageWeakRef]] = {}

    def get(self, t: torch.Tensor, make: Callable[[torch.Tensor], object]) -> object:
        key = _saved_key(t)
        seen = self._seen.get(key)
        if seen is not None and not seen[1].expired():  # expired: the address was freed and reused meanwhile
            return seen[0]
        packed = make(t)
        self._seen[key] = (packed, StorageWeakRef(t.untyped_storage()))
        return packed

    def clear(self) -> None:
        self._seen.clear()


@contextmanager
def _fp8_hooks(region: _Region) -> Iterator[None]:
    """Hooks storing the report's set in FP8: the block input (read by the up/gate projections) and the
    SwiGLU inputs (the gate/up matmul outputs), one copy per tensor however many ops save it. Everything else
    saved in the block (silu(gate), the product, weights) goes to the enclosing hooks, so checkpointing
    recomputes it and offloading moves it."""
    outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
    # Per block call, so a checkpoint's replay quantises afresh and never reads the forward's copies.
    once = _SaveOnce()

    def pack(t: torch.Tensor):
        floating = t.dtype in (torch.float32, torch.bfloat16, torch.float16) and t.numel() > 0
        if floating and (region.reads_input(t) or _is_matmul_output(t)) and is_activation(t):
            return once.get(t, quantize_fp8)
        return _Delegated(outer[0](t), outer[1]) if outer is not None else t

    def unpack(packed):
        if isinstance(packed, Fp8Tiles):
            return dequantize_fp8(packed)
        return packed.unpack(packed.packed) if isinstance(packed, _Delegated) else packed

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
    finally:
        once.clear()  # the graph holds the copies from here on


@dataclass
class OffloadStats:
    """What the offloader moved: tensors and bytes per forward, summed since creation."""

    tensors: int = 0
    bytes: int = 0
    held_bytes: int = 0  # host bytes currently held for a pending backward


@dataclass
class _HostCopy:
    host: torch.Tensor
    device: torch.device
    ready: object = None  # a CUDA event recorded after the device-to-host copy
    stats: OffloadStats | None = None

    def __del__(self) -> None:
        if self.stats is not None:
            self.stats.held_bytes -= self.host.nbytes


def _storage_ptr(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: its local shard's storage
    return local.untyped_storage().data_ptr()


def _state_storages(module: nn.Module) -> set[int]:
    """Storage addresses of a module's parameters and buffers (weights saved for backward stay on the device)."""
    return {_storage_ptr(t) for t in (*module.parameters(), *module.buffers())}


class ActivationOffloader:
    """Saved-tensor hooks that move activations to host memory in the forward and back in the backward."""

    def __init__(self, min_bytes: int = 1 << 14) -> None:
        self.min_bytes = min_bytes
        self.stats = OffloadStats()
        self._stream = None
        # One host copy per tensor saved several times in a forward (gate and up both save the block input).
        self._once = _SaveOnce()
        self._state: set[int] = set()  # the module's parameter and buffer storages, taken per forward

    def pack(self, t: torch.Tensor):
        if t.nbytes < self.min_bytes or not self._moves(t):
            return t
        return self._once.get(t, self._offload)

    def _moves(self, t: torch.Tensor) -> bool:
        """True for an activation; False for the module's weights and buffers, their views and casts."""
        if t.grad_fn is not None or t.requires_grad:
            return is_activation(t)  # a parameter (a leaf needing its grad) or a view/cast of one stays
        # No autograd history: a buffer or a frozen weight -- or an activation an autograd.Function computed and
        # saved inside its forward (RMSNorm's x^, the loss's log-sum-exp), an index, a RoPE table, which
        # is_activation calls constants: those held 23 MiB on the device per forward of the small preset.
        return _storage_ptr(t) not in self._state

    def _offload(self, t: torch.Tensor) -> _HostCopy:
        copy = self._to_host(t)
        self.stats.tensors += 1
        self.stats.bytes += t.nbytes
        self.stats.held_bytes += t.nbytes
        copy.stats = self.stats
        return copy

    def _to_host(self, t: torch.Tensor) -> _HostCopy:
        if t.device.type != "cuda":
            return _HostCopy(t.detach().clone(), t.device)
        if self._stream is None:
            self._stream = torch.cuda.Stream(t.device)
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self._stream.wait_stream(torch.cuda.current_stream(t.device))  # t is fully written
        with torch.cuda.stream(self._stream):
            host.copy_(t, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        t.record_stream(self._stream)  # the allocator must not reuse t's memory before the copy has finished
        return _HostCopy(host, t.device, ready)

    @staticmethod
    def unpack(packed):
        if not isinstance(packed, _HostCopy):
            return packed
        if packed.ready is None:
            return packed.host
        torch.cuda.current_stream(packed.device).wait_event(packed.ready)
        return packed.host.to(packed.device, non_blocking=True)

    @contextmanager
    def hooks(self, module: nn.Module) -> Iterator[None]:
        """Offload what the forward saves inside this block (deduplicated within the block); `module`'s
        parameters and buffers stay where they are."""
        self._state = _state_storages(module)  # per forward: FSDP or `.to()` may have moved them since
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield
        finally:
            self._once.clear()
            self._state = set()


# ---------------------------------------------------------------------------------------------- applying
@dataclass
class MemoryHandle:
    """Undo handle returned by `apply_memory_options`; `offloader` is set when cpu_offload is on."""

    cfg: MemorySection
    offloader: ActivationOffloader | None = None
    _patched: list[tuple[object, str]] = field(default_factory=list)

    def remove(self) -> None:
        """Restore every patched forward (the model is left as it was before)."""
        for obj, name in reversed(self._patched):
            delattr(obj, name)
        self._patched.clear()


def _patch(handle: MemoryHandle, obj: object, name: str, make: Callable[[Callable], Callable]) -> None:
    # An instance attribute shadows the class method; state_dict keys and module structure stay untouched.
    if name in vars(obj):
        raise ValueError(f"{type(obj).__name__}.{name} is already patched (memory options applied twice?)")
    setattr(obj, name, make(getattr(obj, name)))
    handle._patched.append((obj, name))


def _swiglu_region(fp8: bool, forward: Callable) -> Callable:
    @functools.wraps(forward)
    def run(x, *args, **kwargs):
        region = _Region("swiglu", x.untyped_storage().data_ptr())
        with _in_region(region), _fp8_hooks(region) if fp8 else nullcontext():
            return forward(x, *args, **kwargs)
    return run


def _up_proj_region(forward: Callable) -> Callable:
    @functools.wraps(forward)
    def run(*args, **kwargs):
        with _in_region(_Region("up_proj")):
            return forward(*args, **kwargs)
    return run


def _checkpointed_layer(policy: Callable | None, forward: Callable) -> Callable:
    context_fn = functools.partial(create_selective_checkpoint_contexts, policy) if policy else None

    @functools.wraps(forward)
    def run(*args, stats: ForwardStats | None = None, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, stats=stats, **kwargs)
        calls = 0

        def replayable(*a, **kw):
            # The caller's collector goes to the forward only, so counts, aux losses and max logits are taken
            # once. Backward's replay gets an empty collector marked `replay`, dropped afterwards: the layers
            # run the forward's kernels again (the checkpoint checks that the replay saves the same tensors, and
            # selective recompute matches cached outputs by their order) but skip a probe that is not a free
            # by-product of the attention; its no_grad QK^T is never cached (see _selective_policy), so leaving
            # it out shifts nothing, and neither do the elementwise ops of accumulating into a collector.
            nonlocal calls
            calls += 1
            if calls == 1 or stats is None:
                return forward(*a, stats=stats, **kw)
            return forward(*a, stats=stats.empty_like(replay=True), **kw)

        extra = {"context_fn": context_fn} if context_fn else {}
        return checkpoint(replayable, *args, use_reentrant=False, **extra, **kwargs)
    return run


def _offloaded_forward(offloader: ActivationOffloader, module: nn.Module, forward: Callable) -> Callable:
    @functools.wraps(forward)
    def run(*args, **kwargs):
        with offloader.hooks(module):
            return forward(*args, **kwargs)
    return run


def apply_memory_options(model: nn.Module, cfg: MemorySection) -> MemoryHandle:
    """Switch on the `[memory]` options for `model` (a K2ForCausalLM or any module holding decoder layers)."""
    handle = MemoryHandle(cfg)
    try:
        _apply(model, cfg, handle)
    except Exception:
        handle.remove()  # all or nothing
        raise
    return handle


def _apply(model: nn.Module, cfg: MemorySection, handle: MemoryHandle) -> None:
    if cfg.recompute == "selective" or cfg.fp8_saves:
        for module in model.modules():
            if isinstance(module, MLP):
                _patch(handle, module, "forward", functools.partial(_swiglu_region, cfg.fp8_saves))
            elif isinstance(module, RoutedExperts):
                _patch(handle, module, "swiglu", functools.partial(_swiglu_region, cfg.fp8_saves))
            elif isinstance(module, MLAttention) and cfg.recompute == "selective":
                for name in ("q_b_proj", "kv_b_proj"):
                    if hasattr(module, name):
                        _patch(handle, getattr(module, name), "forward", _up_proj_region)
    if cfg.recompute != "none":
        policy = functools.partial(_selective_policy, cfg.fp8_saves) if cfg.recompute == "selective" else None
        for module in model.modules():
            if isinstance(module, DecoderLayer):
                _patch(handle, module, "forward", functools.partial(_checkpointed_layer, policy))
    if cfg.cpu_offload:
        handle.offloader = ActivationOffloader(cfg.offload_min_bytes)
        _patch(handle, model, "forward", functools.partial(_offloaded_forward, handle.offloader, model))


# ---------------------------------------------------------------------------------------------- measuring
class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


@functools.cache
def _libc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        return libc
    except (OSError, AttributeError):
        return None


def allocated_bytes(device: torch.device) -> int | None:
    """Bytes currently allocated for tensors on `device`: CUDA allocator stats, or glibc's heap in use on CPU
    (torch's CPU allocator is plain malloc; None where glibc's mallinfo2 is missing)."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    libc = _libc()
    if libc is None:
        return None
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd
