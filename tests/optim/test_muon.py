"""Tests for openk2.optim.muon: torch.optim.Muon agreement, Newton-Schulz, 3-D experts, state."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
import torch.optim._muon as torch_muon_impl

from openk2.optim.muon import NS_COEFFICIENTS, Muon, apply_muon_update, muon_momentum, zeropower_via_newtonschulz5
from openk2.optim.newton_schulz import NS_KERNELS

MU = 0.95


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Run single-threaded: small matmuls gain nothing from threads, and stall on a busy 2-core box."""
    # Measured: a 96x48 fp64 Newton-Schulz took 0.7 ms on 1 thread and 230 ms on 2 under load.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def reference_ns(X: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The spec's Newton-Schulz in float64, one matrix at a time."""
    a, b, c = NS_COEFFICIENTS
    X = X.double()
    tall = X.size(0) > X.size(1)
    if tall:
        X = X.T
    X = X / (X.norm() + 1e-7)
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error of x against ref."""
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def make_params(shapes, seed=0, dtype=torch.float32):
    """Random parameters, one per shape."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.02).to(dtype)) for s in shapes]


def clone_params(params):
    """Independent copies of parameters."""
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def run_steps(opt, params, grads_per_step):
    """Feed the given gradients to opt for several steps."""
    for grads in grads_per_step:
        for p, g in zip(params, grads, strict=True):
            p.grad = g.to(p.dtype).clone()
        opt.step()


def random_grads(shapes, steps, seed=1):
    """Per-step lists of random gradients."""
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen) for s in shapes] for _ in range(steps)]


SHAPES_2D = [(64, 64), (96, 48), (32, 80), (48, 96)]


# --- relation to torch.optim.Muon -------------------------------------------------------------------


def test_torch_momentum_is_ours_scaled_by_one_minus_mu():
    """torch's lerp momentum is (1 - mu) * ours, and so is its Nesterov input, at every step."""
    # Ours: M <- mu M + G, U = G + mu M. torch: B <- B.lerp(G, 1 - mu) = mu B + (1 - mu) G, so
    # B = (1 - mu) M by induction, and V = G.lerp(B, mu) = (1 - mu) G + mu (1 - mu) M = (1 - mu) U.
    gen = torch.Generator().manual_seed(0)
    M = torch.zeros(8, 8, dtype=torch.float64)
    B = torch.zeros_like(M)
    for _ in range(6):
        G = torch.randn(8, 8, generator=gen, dtype=torch.float64)
        M = MU * M + G
        U = G + MU * M
        B = B.lerp(G, 1 - MU)
        V = G.lerp(B, MU)
        torch.testing.assert_close(B, (1 - MU) * M)
        torch.testing.assert_close(V, (1 - MU) * U)


def test_newton_schulz_is_scale_invariant():
    """Frobenius normalisation makes the (1 - mu) factor between the two momentum forms irrelevant."""
    X = torch.randn(48, 96, generator=torch.Generator().manual_seed(0))
    out = zeropower_via_newtonschulz5(X, dtype=torch.float32)
    scaled = zeropower_via_newtonschulz5((1 - MU) * X, dtype=torch.float32)
    torch.testing.assert_close(out, scaled, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("nesterov", [True, False])
def test_matches_torch_muon_exactly_with_fp64_newton_schulz(monkeypatch, nesterov):
    """With the NS precision taken out, our steps equal torch's match_rms_adamw Muon to fp32 rounding."""

    def fp64_ns(grad, ns_coefficients, ns_steps, eps):
        return reference_ns(grad, ns_steps).float()

    monkeypatch.setattr(torch_muon_impl, "_zeropower_via_newtonschulz", fp64_ns)
    lr, wd = 0.02, 0.1
    ours_params = make_params(SHAPES_2D)
    torch_params = clone_params(ours_params)
    ours = Muon(ours_params, lr=lr, weight_decay=wd, nesterov=nesterov, ns_dtype=torch.float32)
    theirs = torch.optim.Muon(
        torch_params, lr=lr, momentum=MU, nesterov=nesterov, weight_decay=wd, adjust_lr_fn="match_rms_adamw"
    )
    grads = random_grads(SHAPES_2D, steps=5)
    run_steps(ours, ours_params, grads)
    run_steps(theirs, torch_params, grads)
    for a, b in zip(ours_params, torch_params, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kernel", [None, *sorted(NS_KERNELS)])
def test_matches_torch_muon_in_bf16(kernel):
    """Every Newton-Schulz kernel (and the measured default) agrees with torch.optim.Muon to bf16 noise."""
    lr, wd = 0.02, 0.1
    ours_params = make_params(SHAPES_2D)
    torch_params = clone_params(ours_params)
    start = [p.detach().clone() for p in ours_params]
    ours = Muon(ours_params, lr=lr, weight_decay=wd, ns_kernel=kernel)
    theirs = torch.optim.Muon(
        torch_params, lr=lr, momentum=MU, nesterov=True, weight_decay=wd, adjust_lr_fn="match_rms_adamw"
    )
    grads = random_grads(SHAPES_2D, steps=5)
    run_steps(ours, ours_params, grads)
    run_steps(theirs, torch_params, grads)
    for a, b, w0 in zip(ours_params, torch_params, start, strict=True):
        # bf16 NS carries ~1-2% relative noise (torch against itself on a rescaled input shows the
        # same), so compare the accumulated displacement at a few times that level.
        assert rel_err(a.detach() - w0, b.detach() - w0) < 0.05


# --- Newton-Schulz -------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(64, 64), (96, 48), (64, 256)])
@pytest.mark.parametrize("kernel", sorted(NS_KERNELS))
def test_newton_schulz_matches_fp64_reference(shape, kernel):
    """bf16 NS (any kernel) is within bf16 noise of the fp64 iteration; fp32 is tight."""
    X = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    ref = reference_ns(X)
    out = zeropower_via_newtonschulz5(X, kernel=kernel)
    assert out.dtype == torch.bfloat16 and out.shape == X.shape
    # torch.optim.Muon's own bf16 NS measures 1.2-1.5% against this reference on these shapes.
    assert rel_err(out, ref) < 0.03
    assert rel_err(zeropower_via_newtonschulz5(X, dtype=torch.float32), ref) < 1e-4


def _scalar_band(sigmas: np.ndarray, steps: int = 5) -> tuple[float, float]:
    """Range of the scalar quintic, iterated, over the interval spanned by normalised singular values."""
    a, b, c = NS_COEFFICIENTS
    x = np.linspace(sigmas.min(), sigmas.max(), 100_001)
    for _ in range(steps):
        x = a * x + b * x**3 + c * x**5
    return float(x.min()), float(x.max())


@pytest.mark.parametrize("shape", [(64, 128), (128, 64), (4, 48, 160)])
def test_newton_schulz_singular_values_in_band(shape):
    """Output singular values lie where the scalar iteration sends the normalised input's ones."""
    X = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    out = zeropower_via_newtonschulz5(X).float()
    for x, o in zip(X.reshape(-1, *shape[-2:]), out.reshape(-1, *shape[-2:]), strict=True):
        s_in = torch.linalg.svdvals(x.double() / x.double().norm()).numpy()
        lo, hi = _scalar_band(s_in)
        s_out = torch.linalg.svdvals(o.double()).numpy()
        # NS acts on each singular value through the scalar map f(x) = a x + b x^3 + c x^5, so the
        # outputs lie in f^5([min, max]); 0.05 allows for bf16 rounding (~2% of each value).
        assert lo - 0.05 <= s_out.min() and s_out.max() <= hi + 0.05
        # For these coefficients and well-spread spectra f^5 maps [0.003, 1] into [0.68, 1.21].
        assert 0.6 < s_out.min() and s_out.max() < 1.25


def test_newton_schulz_batched_equals_per_matrix():
    """A 3-D batch is orthogonalised per matrix, identically to separate 2-D calls."""
    X = torch.randn(5, 48, 96, generator=torch.Generator().manual_seed(0))
    for kernel in NS_KERNELS:
        batched = zeropower_via_newtonschulz5(X, kernel=kernel)
        looped = torch.stack([zeropower_via_newtonschulz5(x, kernel=kernel) for x in X])
        torch.testing.assert_close(batched, looped, rtol=0, atol=0)


def test_newton_schulz_leaves_input_alone():
    """The public function never writes to its argument (Muon lets it reuse its own batch buffer)."""
    X = torch.randn(3, 40, 24, generator=torch.Generator().manual_seed(0))
    before = X.clone()
    for kernel in NS_KERNELS:
        zeropower_via_newtonschulz5(X, kernel=kernel)
        zeropower_via_newtonschulz5(X[0], kernel=kernel)
    torch.testing.assert_close(X, before, rtol=0, atol=0)


def test_newton_schulz_rejects_bad_input():
    """1-D and 4-D inputs and negative step counts raise ValueError."""
    with pytest.raises(ValueError):
        zeropower_via_newtonschulz5(torch.randn(8))
    with pytest.raises(ValueError):
        zeropower_via_newtonschulz5(torch.randn(2, 2, 4, 4))
    with pytest.raises(ValueError):
        zeropower_via_newtonschulz5(torch.randn(4, 4), steps=-1)


# --- the shared update rule (Muon and DistributedMuon) ---------------------------------------------


@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_momentum_follows_formula_and_writes_into_out(nesterov):
    """M <- mu M + G in place; the direction G + mu M (or M) lands in the given, even transposed, views."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(6, 10), (10, 6)]
    bufs = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]  # non-zero: mu M matters
    grads = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    expected_bufs = [MU * m + g for m, g in zip(bufs, grads, strict=True)]
    expected = [g + MU * m if nesterov else m for g, m in zip(grads, expected_bufs, strict=True)]
    batch = torch.full((2, 6, 10), float("nan"), dtype=torch.float64)
    out = muon_momentum(bufs, grads, MU, nesterov=nesterov, out=[batch[0], batch[1].mT])
    assert out[0].data_ptr() == batch[0].data_ptr() and out[1].data_ptr() == batch[1].data_ptr()
    for buf, m, d, e in zip(bufs, expected_bufs, out, expected, strict=True):
        torch.testing.assert_close(buf, m)
        torch.testing.assert_close(d, e)
    torch.testing.assert_close(batch[1], expected[1].T)
    fresh = muon_momentum([torch.ones(3, 4)], [torch.full((3, 4), 2.0)], 0.5, nesterov=nesterov)[0]
    assert torch.equal(fresh, torch.full((3, 4), 2.0 + 0.5 * 2.5 if nesterov else 2.5))


@pytest.mark.parametrize("weight_decay", [0.1, 0.0])
def test_apply_muon_update_follows_formula(weight_decay):
    """W <- (1 - lr wd) W - lr * 0.2 * sqrt(max(n, m)) * O, for whole matrices, bf16 ones and flat slices."""
    lr, rms = 0.03, 0.2
    gen = torch.Generator().manual_seed(0)
    W = torch.randn(48, 16, generator=gen)  # tall: the scale uses n = 48, not m
    O = torch.randn(48, 16, generator=gen)
    W16 = W.to(torch.bfloat16)
    flat = torch.randn(100, generator=gen)  # a ZeRO-style slice: elements 20..60 hold part of a 48 x 16 matrix
    flat0 = flat.clone()
    expected = (1 - lr * weight_decay) * W.double() - lr * rms * math.sqrt(48) * O.double()
    expected16 = ((1 - lr * weight_decay) * W16.float() - lr * rms * math.sqrt(48) * O).to(torch.bfloat16)
    piece = O.reshape(-1)[100:140]  # the part of the matrix's O that the slice holds
    expected_flat = (1 - lr * weight_decay) * flat0[20:60].double() - lr * rms * math.sqrt(48) * piece.double()
    apply_muon_update([W, W16, flat[20:60]], [O, O, piece], lr=lr, weight_decay=weight_decay,
                      rms_scale=rms, shape=(48, 16))
    torch.testing.assert_close(W.double(), expected)
    assert W16.dtype == torch.bfloat16
    torch.testing.assert_close(W16, expected16, rtol=0, atol=0)
    torch.testing.assert_close(flat[20:60].double(), expected_flat)
    assert torch.equal(flat[:20], flat0[:20]) and torch.equal(flat[60:], flat0[60:])
    # An expert stack [E, n, m] is scaled by its matrices' max(n, m), not by E.
    E = torch.zeros(64, 8, 16)
    apply_muon_update([E], [torch.ones_like(E)], lr=1.0, weight_decay=0.0, rms_scale=rms, shape=E.shape)
    torch.testing.assert_close(E, torch.full_like(E, -rms * 4.0))


# --- update size ------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(256, 256), (128, 512), (512, 128), (1024, 256)])
def test_update_rms_is_about_rms_scale(shape):
    """(W*(1 - lr*wd) - W_new) / lr has RMS ~0.2 for full-rank matrices of any aspect ratio."""
    lr, wd = 1e-2, 0.1
    (W,) = make_params([shape])
    W0 = W.detach().clone()
    W.grad = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    Muon([W], lr=lr, weight_decay=wd).step()
    update = (W0 * (1 - lr * wd) - W.detach()) / lr
    rms = update.pow(2).mean().sqrt().item()
    # RMS = 0.2 * sqrt(mean sigma^2) with NS singular values in ~[0.68, 1.2]; measured 0.17-0.19.
    assert 0.15 < rms < 0.22
    sigma = torch.linalg.svdvals(update.double() / (0.2 * math.sqrt(max(shape))))
    assert rms == pytest.approx(0.2 * sigma.pow(2).sum().div(W.numel()).sqrt().item() * math.sqrt(max(shape)))


# --- 3-D experts, mixed shapes, dtypes ------------------------------------------------------------


@pytest.mark.parametrize("expert_shape", [(4, 32, 64), (4, 64, 32)])
def test_3d_experts_equal_2d_loop(expert_shape):
    """A [E, n, m] parameter evolves exactly like E separate 2-D parameters."""
    E = expert_shape[0]
    (stacked,) = make_params([expert_shape])
    split = [torch.nn.Parameter(stacked.detach()[e].clone()) for e in range(E)]
    opt3 = Muon([stacked], lr=0.02)
    opt2 = Muon(split, lr=0.02)
    for grads in random_grads([expert_shape], steps=4):
        stacked.grad = grads[0].clone()
        for e, p in enumerate(split):
            p.grad = grads[0][e].clone()
        opt3.step()
        opt2.step()
    torch.testing.assert_close(stacked.detach(), torch.stack([p.detach() for p in split]), rtol=0, atol=0)


def test_mixed_shapes_share_batches_without_changing_results():
    """Bucketing (tall matrices transposed in beside wide ones, experts beside 2-D) changes nothing."""
    shapes = [(32, 64), (64, 32), (3, 32, 64), (3, 64, 32), (16, 16), (24, 40)]
    params = make_params(shapes)
    alone = clone_params(params)
    together = Muon(params, lr=0.02)
    singles = [Muon([p], lr=0.02) for p in alone]
    for grads in random_grads(shapes, steps=3):
        for p, q, g in zip(params, alone, grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        together.step()
        for opt in singles:
            opt.step()
    for p, q in zip(params, alone, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_bf16_params_track_fp32_params():
    """bf16 parameters stay bf16, keep fp32 momentum and follow the fp32 trajectory to bf16 precision."""
    shapes = [(64, 32), (2, 32, 48)]
    p32 = make_params(shapes)
    p16 = [torch.nn.Parameter(p.detach().to(torch.bfloat16)) for p in p32]
    opt32, opt16 = Muon(p32, lr=0.02), Muon(p16, lr=0.02)
    grads = random_grads(shapes, steps=4)
    run_steps(opt32, p32, grads)
    run_steps(opt16, p16, grads)
    for a, b in zip(p32, p16, strict=True):
        assert b.dtype == torch.bfloat16
        assert opt16.state[b]["momentum_buffer"].dtype == torch.float32
        assert rel_err(b.detach(), a.detach()) < 0.02


@pytest.mark.parametrize("nesterov", [True, False])
def test_momentum_buffer_follows_formula(nesterov):
    """The fp32 buffer is exactly M <- mu M + G, even for bf16 params (Newton-Schulz never writes to it)."""
    # torch.optim.Muon 2.13 with bf16 params and nesterov=False normalises its bf16 buffer in place
    # (grad.bfloat16() is the buffer itself, then div_); keep ours free of that.
    shapes = [(16, 32), (32, 16)]
    params = make_params(shapes, dtype=torch.bfloat16)
    opt = Muon(params, lr=0.01, nesterov=nesterov)
    expected = [torch.zeros(s) for s in shapes]
    for grads in random_grads(shapes, steps=3):
        grads = [10 * g.to(torch.bfloat16) for g in grads]
        run_steps(opt, params, [grads])
        for p, g, m in zip(params, grads, expected, strict=True):
            m.mul_(MU).add_(g.float())
            torch.testing.assert_close(opt.state[p]["momentum_buffer"], m, rtol=0, atol=0)


def test_zero_gradient_only_decays():
    """An all-zero gradient gives a zero orthogonalised update, leaving just the weight decay."""
    (W,) = make_params([(8, 8)])
    W0 = W.detach().clone()
    W.grad = torch.zeros(8, 8)
    Muon([W], lr=0.1, weight_decay=0.5).step()
    torch.testing.assert_close(W.detach(), W0 * (1 - 0.1 * 0.5))


def test_params_without_grad_are_untouched():
    """A parameter whose grad is None gets neither an update nor weight decay."""
    a, b = make_params([(16, 32), (16, 32)])
    before = b.detach().clone()
    a.grad = torch.randn(16, 32)
    Muon([a, b], lr=0.1).step()
    torch.testing.assert_close(b.detach(), before, rtol=0, atol=0)
    assert not torch.equal(a.detach(), before)


# --- state dict -------------------------------------------------------------------------------------


def test_state_dict_round_trip():
    """Saving and restoring mid-run (via torch.save / weights_only load) gives identical later steps."""
    shapes = [(32, 64), (3, 48, 16), (40, 24)]
    dtypes = [torch.float32, torch.float32, torch.bfloat16]
    params = [p.to(dt) for p, dt in zip(make_params(shapes), dtypes, strict=True)]
    params = [torch.nn.Parameter(p.detach()) for p in params]
    grads = random_grads(shapes, steps=6)
    opt = Muon(params, lr=0.02)
    run_steps(opt, params, grads[:3])

    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    restored_params = clone_params(params)
    restored = Muon(restored_params, lr=0.5)  # lr comes back from the state dict
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    assert restored.param_groups[0]["lr"] == 0.02
    assert restored.state[restored_params[2]]["momentum_buffer"].dtype == torch.float32

    run_steps(opt, params, grads[3:])
    run_steps(restored, restored_params, grads[3:])
    for p, q in zip(params, restored_params, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


# --- validation -------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(8,), (), (2, 2, 4, 4)])
def test_rejects_non_matrix_params(shape):
    """1-D (norms, biases), 0-D and 4-D parameters are refused with a pointer to AdamW."""
    with pytest.raises(ValueError, match="AdamW"):
        Muon([torch.nn.Parameter(torch.zeros(shape))], lr=0.1)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"lr": -1.0},
        {"momentum": 1.0},
        {"momentum": -0.1},
        {"weight_decay": -0.1},
        {"ns_steps": 0},
        {"rms_scale": 0.0},
        {"ns_dtype": torch.int32},
    ],
)
def test_rejects_bad_hyperparameters(kwargs):
    """Out-of-range hyperparameters raise ValueError."""
    kwargs = {"lr": 0.1, **kwargs}
    with pytest.raises(ValueError):
        Muon([torch.nn.Parameter(torch.zeros(4, 4))], **kwargs)


def test_add_param_group_validates_and_leaves_no_trace():
    """A rejected param group is not left behind in the optimizer."""
    opt = Muon([torch.nn.Parameter(torch.zeros(4, 4))], lr=0.1)
    with pytest.raises(ValueError):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(4))]})
    with pytest.raises(ValueError):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(4, 4))], "lr": -1.0})
    assert len(opt.param_groups) == 1
