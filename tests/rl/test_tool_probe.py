"""The tool warm-up's adaptive stop (rl/tool_probe.py): the rule stops at the first check that reaches the band,
respects the cap, and its probe problems are never held out and never trained on."""

import json
from itertools import islice
from pathlib import Path

import pytest
import torch

from openk2.rl import tool_warmup
from openk2.rl.config import EnvSection, load_rl_config
from openk2.rl.mixture import MixtureEnv, build_mixture, held_out_problems
from openk2.rl.tasks.lookup import LookupTask
from openk2.rl.tool_probe import PROBE_FILE, ProbeStop, exclude_probes, probe_problems
from openk2.rl.tool_warmup import mixed_stream, run_tool_warmup
from tests.rl.test_trainer import MICRO

TOOLS = Path(__file__).resolve().parents[2] / "configs" / "rl-tools-tiny.toml"


class FewShops(LookupTask):
    """The lookup task over only 12 distinct shops, so that overlaps would show up within a few draws."""

    def generate(self, seed: int, difficulty: int = 1):
        return super().generate(seed % 12, difficulty)


def few_shops_env() -> MixtureEnv:
    task = FewShops()
    held_out = held_out_problems(task, [1], 4, seed=3)
    return MixtureEnv(EnvSection(name="lookup"), task, 48, held_out, {p.prompt for p in held_out})


def test_stop_rule_stops_at_the_first_check_in_the_band():
    rule = ProbeStop(every=10, low=0.2, high=0.6, cap=100)
    assert [s for s in range(1, 101) if rule.due(s)] == list(range(10, 101, 10))
    scores = {10: 0.0, 20: 0.1, 30: 0.35, 40: 0.5}
    stopped = next(s for s in (10, 20, 30, 40) if rule.check(s, scores[s]))  # the warm-up loop breaks there
    assert stopped == rule.stopped_at == 30 and [s for s, _ in rule.trace] == [10, 20, 30]
    assert rule.summary()["band"] == "in"
    jumped = ProbeStop(every=10, low=0.2, high=0.6, cap=100)
    assert not jumped.check(10, 0.1) and jumped.check(20, 0.9)  # past the band between two checks: stop too
    assert jumped.summary()["band"] == "above"


def test_stop_rule_respects_the_cap():
    rule = ProbeStop(every=30, low=0.2, high=0.6, cap=70)
    due = [s for s in range(1, 71) if rule.due(s)]
    assert due == [30, 60, 70]  # the cap is checked too, so the log holds the final probe score
    assert not any(rule.check(s, 0.1) for s in due)
    summary = rule.summary()
    assert (summary["stopped_at"], summary["steps"], summary["band"]) == (None, 70, "below")


def test_probe_set_is_never_held_out_nor_trained_on():
    env = few_shops_env()
    held_out = {p.prompt for p in env.eval_problems}
    probes = exclude_probes([env], 4, seed=3)["lookup"]
    probe = {p.prompt for p in probes}
    assert len(probe) == 4 and not probe & held_out
    assert probe == {p.prompt for p in probe_problems(env, 4, seed=3)}  # the same set every time (resume)
    trained = {p.prompt for p in islice(mixed_stream([env], seed=1), 200)}  # the warm-up's stream
    trained |= {env.draw(s, 0).prompt for s in range(200)}  # RL's draws
    assert len(trained) == 4 and not trained & (probe | held_out)  # the 12 shops, minus 4 held out, minus 4 probes
    with pytest.raises(ValueError, match="probe_problems"):
        probe_problems(few_shops_env(), 9, seed=3)  # only 8 shops are not held out


def test_shipped_probe_is_disjoint_from_the_held_out_shops():
    cfg = load_rl_config(TOOLS)
    (env,) = build_mixture(cfg, cfg.train.seed)
    assert cfg.warmup.probe_problems > 0
    exclude_probes([env], cfg.warmup.probe_problems, cfg.train.seed)  # as the trainer does (fresh or resumed)
    probe = {p.prompt for p in probe_problems(env, cfg.warmup.probe_problems, cfg.train.seed)}
    assert len(probe) == cfg.warmup.probe_problems
    assert not probe & {p.prompt for p in env.eval_problems} and probe <= env.exclude


def test_bad_probe_settings_are_rejected(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(f'base = "{TOOLS.as_posix()}"\n[warmup]\nprobe_low = 0.7\nprobe_high = 0.6\n')
    with pytest.raises(ValueError, match="probe_low"):
        load_rl_config(bad)


@pytest.mark.slow
def test_the_warmup_stops_where_the_probe_says(tmp_path, monkeypatch):
    threads = torch.get_num_threads()
    cfg = load_rl_config(TOOLS, [*MICRO, "warmup.steps=10", "warmup.probe_problems=2", "warmup.probe_every=2",
                                 "model.max_position_embeddings=320", "warmup.batch_size=4"])
    envs = build_mixture(cfg, cfg.train.seed)
    real, calls = tool_warmup.probe_score, []

    def scripted(model, tokenizer, envs, probes, cfg):
        real_score = real(model, tokenizer, envs, probes, cfg)  # the real probe runs, and leaves train mode on
        assert 0.0 <= real_score <= 1.0 and model.training and len(probes["lookup"]) == 2
        calls.append(real_score)
        return [0.0, 0.1, 0.4, 0.5][len(calls) - 1]

    monkeypatch.setattr(tool_warmup, "probe_score", scripted)
    try:
        run_tool_warmup(cfg, envs, tmp_path)
    finally:
        torch.set_num_threads(threads)
    assert len(calls) == 3  # steps 2, 4, 6; the warm-up ended at 6 (no check at 8 or at the cap, 10)
    summary = json.loads((tmp_path / "warmup" / PROBE_FILE).read_text())
    assert (summary["stopped_at"], summary["band"]) == (6, "in")
    assert [c["step"] for c in summary["checks"]] == [2, 4, 6]
