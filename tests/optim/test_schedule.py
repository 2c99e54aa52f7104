"""Tests for openk2.optim.schedule: WSD stage boundaries, token conversion, the K2 recipe, scheduler state."""

from __future__ import annotations

import io

import pytest
import torch

from openk2.optim.schedule import KIMI_K2_TOKENS_PER_STEP, WSDConfig, WSDScheduler, tokens_to_steps, wsd_lr

CFG = WSDConfig(
    peak_lr=2e-4,
    warmup_steps=10,
    stable_steps=20,
    decay_steps=30,
    decay_floor=2e-5,
    anneal_steps=8,
    anneal_floor=7e-6,
)
END_WARMUP = 10
END_STABLE = 30
END_DECAY = 60
END_ANNEAL = 68


def test_stage_boundaries():
    """Warm-up ends at peak, stable holds peak, decay ends at its floor, anneal ends at its floor."""
    assert wsd_lr(0, CFG) == 0.0
    assert wsd_lr(5, CFG) == pytest.approx(1e-4)
    assert wsd_lr(END_WARMUP, CFG) == pytest.approx(2e-4)
    assert all(wsd_lr(s, CFG) == 2e-4 for s in range(END_WARMUP, END_STABLE))
    assert wsd_lr(END_STABLE + 15, CFG) == pytest.approx((2e-4 + 2e-5) / 2)  # cosine midpoint
    assert wsd_lr(END_DECAY, CFG) == pytest.approx(2e-5)
    assert wsd_lr(END_DECAY + 4, CFG) == pytest.approx((2e-5 + 7e-6) / 2)  # linear midpoint
    assert wsd_lr(END_ANNEAL, CFG) == pytest.approx(7e-6)
    assert wsd_lr(10 * END_ANNEAL, CFG) == pytest.approx(7e-6)
    assert CFG.total_steps == END_ANNEAL


def test_monotone_after_warmup():
    """The lr never increases after warm-up and strictly decreases through decay and anneal."""
    lrs = [wsd_lr(s, CFG) for s in range(END_WARMUP, END_ANNEAL + 5)]
    assert all(b <= a for a, b in zip(lrs, lrs[1:], strict=False))
    falling = [wsd_lr(s, CFG) for s in range(END_STABLE, END_ANNEAL + 1)]
    assert all(b < a for a, b in zip(falling, falling[1:], strict=False))
    warm = [wsd_lr(s, CFG) for s in range(END_WARMUP + 1)]
    assert all(b > a for a, b in zip(warm, warm[1:], strict=False))


def test_warmup_start_and_shapes():
    """warmup_start sets the first lr; linear decay and cosine anneal follow their curves."""
    cfg = WSDConfig(
        peak_lr=1.0,
        warmup_steps=4,
        stable_steps=0,
        decay_steps=10,
        decay_floor=0.5,
        anneal_steps=10,
        anneal_floor=0.1,
        warmup_start=0.25,
        decay_shape="linear",
        anneal_shape="cosine",
    )
    assert wsd_lr(0, cfg) == pytest.approx(0.25)
    assert wsd_lr(2, cfg) == pytest.approx(0.625)
    assert wsd_lr(4 + 3, cfg) == pytest.approx(1.0 - 0.5 * 0.3)
    assert wsd_lr(14 + 5, cfg) == pytest.approx(0.3)  # cosine midpoint
    assert wsd_lr(14 + 2, cfg) > 0.5 - 0.4 * 0.2  # cosine starts slower than linear
    assert wsd_lr(24, cfg) == pytest.approx(0.1)


def test_no_anneal_holds_decay_floor():
    """Without an annealing stage the schedule holds decay_floor after decay."""
    cfg = WSDConfig(peak_lr=1.0, warmup_steps=0, stable_steps=2, decay_steps=4, decay_floor=0.1)
    assert wsd_lr(0, cfg) == 1.0
    assert wsd_lr(6, cfg) == pytest.approx(0.1)
    assert wsd_lr(100, cfg) == pytest.approx(0.1)


def test_tokens_to_steps_and_from_tokens():
    """Token budgets become step counts, rounded up."""
    assert tokens_to_steps(1000, 100) == 10
    assert tokens_to_steps(1001, 100) == 11
    assert tokens_to_steps(0, 100) == 0
    cfg = WSDConfig.from_tokens(
        tokens_per_step=1_000,
        peak_lr=1e-3,
        warmup_steps=5,
        stable_tokens=50_000,
        decay_tokens=20_500,
        decay_floor=1e-4,
        anneal_tokens=3_000,
        anneal_floor=1e-5,
        anneal_shape="cosine",
    )
    assert (cfg.warmup_steps, cfg.stable_steps, cfg.decay_steps, cfg.anneal_steps) == (5, 50, 21, 3)
    assert cfg.anneal_shape == "cosine"
    with pytest.raises(ValueError):
        tokens_to_steps(10, 0)
    with pytest.raises(ValueError):
        tokens_to_steps(-1, 10)


def test_kimi_k2_recipe():
    """K2: 500 warm-up steps, 2e-4 up to 10T tokens, cosine to 2e-5 over 5.5T, 2e-5 -> 7e-6 over 400B."""
    cfg = WSDConfig.kimi_k2()
    assert KIMI_K2_TOKENS_PER_STEP == 67_108_864
    # ceil(10e12 / 2**26) = 149_012 steps hold the first 10T tokens, warm-up included.
    assert (cfg.warmup_steps, cfg.stable_steps) == (500, 149_012 - 500)
    assert cfg.decay_steps == 81_957  # ceil(5.5e12 / 2**26)
    assert cfg.anneal_steps == 5_961  # ceil(400e9 / 2**26)
    assert (cfg.peak_lr, cfg.decay_floor, cfg.anneal_floor) == (2e-4, 2e-5, 7e-6)
    tokens = cfg.total_steps * KIMI_K2_TOKENS_PER_STEP
    assert tokens == pytest.approx(15.9e12, rel=1e-3)  # 10T + 5.5T + 0.4T
    assert wsd_lr(149_011, cfg) == 2e-4
    assert wsd_lr(149_012 + 81_957, cfg) == pytest.approx(2e-5)
    assert wsd_lr(cfg.total_steps, cfg) == pytest.approx(7e-6)
    exact = WSDConfig.kimi_k2(tokens_per_step=67_000_000)
    assert exact.decay_steps == 82_090


@pytest.mark.parametrize(
    "kwargs",
    [
        {"peak_lr": 0.0},
        {"warmup_steps": -1},
        {"decay_steps": 1.5},
        {"decay_floor": 1.0},
        {"anneal_steps": 5},  # missing anneal_floor
        {"anneal_steps": 5, "anneal_floor": 0.2},  # above decay_floor
        {"warmup_start": 1.5},
        {"decay_shape": "step"},
    ],
)
def test_config_validation(kwargs):
    """Bad configs raise ValueError; the config is keyword-only."""
    base = dict(peak_lr=0.5, warmup_steps=1, stable_steps=1, decay_steps=1, decay_floor=0.1)
    with pytest.raises(ValueError):
        WSDConfig(**{**base, **kwargs})
    with pytest.raises(ValueError):
        wsd_lr(-1, WSDConfig(**base))
    with pytest.raises(TypeError):
        WSDConfig(0.5, 1, 1, 1, 0.1)  # type: ignore[misc]


def _optimizer(lr: float = 123.0, groups: int = 1) -> torch.optim.Optimizer:
    """A throwaway optimizer with the given number of param groups."""
    return torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(2))]} for _ in range(groups)], lr=lr)


def test_scheduler_follows_wsd_lr_on_all_groups():
    """The scheduler sets every group of every optimizer to wsd_lr(step) after each step."""
    opts = [_optimizer(groups=2), _optimizer(groups=1)]
    scheds = [WSDScheduler(opt, CFG) for opt in opts]
    for step in range(END_ANNEAL + 3):
        for opt, sched in zip(opts, scheds, strict=True):
            assert [g["lr"] for g in opt.param_groups] == [wsd_lr(step, CFG)] * len(opt.param_groups)
            assert sched.get_last_lr() == [wsd_lr(step, CFG)] * len(opt.param_groups)
            opt.step()
            sched.step()


def test_scheduler_state_dict_round_trip():
    """A scheduler restored mid-run (weights_only load) continues the same lr sequence and config."""
    opt = _optimizer()
    sched = WSDScheduler(opt, CFG)
    for _ in range(25):
        opt.step()
        sched.step()
    buffer = io.BytesIO()
    torch.save(sched.state_dict(), buffer)
    buffer.seek(0)

    other_cfg = WSDConfig(peak_lr=1.0, warmup_steps=0, stable_steps=1, decay_steps=1, decay_floor=0.0)
    opt2 = _optimizer()
    sched2 = WSDScheduler(opt2, other_cfg)
    sched2.load_state_dict(torch.load(buffer, weights_only=True))
    assert sched2.cfg == CFG
    assert sched2.last_epoch == sched.last_epoch
    for _ in range(50):
        opt.step()
        sched.step()
        opt2.step()
        sched2.step()
        assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
