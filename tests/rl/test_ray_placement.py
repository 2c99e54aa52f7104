"""Ray placement: real Ray actors as rollout workers, fed by the checkpoint engine over a gloo group, reproduce
the colocated loop bit for bit on a mixture of arithmetic (partial rollout) and the multi-turn lookup tool
environment (its episodes played on the workers); the workers run on another Ray node than the trainer (a
two-node `ray.cluster_utils.Cluster` on this machine); a killed worker is a one-line error in the driver, not a
hang."""

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from openk2.rl.config import load_rl_config
from openk2.rl.group_split import merge_groups, split_groups
from openk2.rl.placement import RolloutWorkerError
from openk2.rl.ray_worker import state_digest
from openk2.rl.rollout import new_group
from openk2.rl.routing_replay import expected_rows
from openk2.rl.tasks import Problem

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "rl-tiny.toml"
MICRO = [  # the shipped config shrunk to seconds; level-1 problems so that the warm-up's policy earns some reward
    "model.hidden_size=64", "model.intermediate_size=128", "model.moe_intermediate_size=32", "model.q_lora_rank=32",
    "model.n_routed_experts=4", "warmup.steps=40", "warmup.batch_size=8", "warmup.tokenizer_examples=300",
    "task.difficulties=[1]", "task.eval_problems=8", "rollout.prompts_per_iteration=4",
    "rollout.samples_per_prompt=4", "rollout.max_tokens=12", "rollout.segment_tokens=6", "rollout.max_batch_size=16",
    "rollout.temperature_decay_iterations=4", "train.iterations=4", "train.threads=1",
    "rollout.worker_timeout_s=60",
]
MIXTURE = """base = "{base}"

[model]
max_position_embeddings = 320  # the tool declaration, the question and up to three turns with their results

[[envs]]
name = "arithmetic"
difficulties = [1]

[[envs]]
name = "lookup"
difficulties = [1]
max_tokens = 40
max_turns = 3
eval_problems = 4
"""
ITERATIONS = 3
KEYS = ("reward_mean", "reward_penalised_mean", "new_tokens", "paused", "resumed", "groups_trained", "updates",
        "response_len", "loss", "entropy")
TOOL_KEYS = ("reward_mean/lookup", "groups_trained/lookup", "response_len/lookup", "tool_calls/lookup",
             "malformed_rate/lookup", "turns/lookup", "answered/lookup")  # the episodes: the same on every placement


def _problem(i: int) -> Problem:
    return Problem(prompt=f"p{i}", data={"answer": i})


def test_split_is_deterministic_and_merge_restores_the_colocated_order():
    groups = [new_group(gid, _problem(gid), [1, 2], 2, 0) for gid in (7, 2, 5, 4, 9)]
    shares = split_groups(groups, 2)
    assert [[g.group_id for g in s] for s in shares] == [[2, 4], [7, 5, 9]]
    groups[1].trajectories[0].finish_reason = groups[1].trajectories[1].finish_reason = "stop"  # group 2 done
    returned = [g for s in reversed(shares) for g in s]  # the workers answer in any order
    done, paused = merge_groups([g.group_id for g in groups], returned)
    assert [g.group_id for g in done] == [2] and [g.group_id for g in paused] == [7, 5, 4, 9]
    with pytest.raises(RuntimeError, match="expected"):
        merge_groups([1, 2], returned)
    with pytest.raises(ValueError, match="num_workers"):
        split_groups(groups, 0)


def test_config_rejects_an_unknown_placement():
    with pytest.raises(ValueError, match="colocated or ray"):
        load_rl_config(CONFIG, ["rollout.placement='slurm'"])
    with pytest.raises(ValueError, match="worker_num_cpus"):
        load_rl_config(CONFIG, ["rollout.worker_num_cpus=0"])


def test_standalone_group_syncs_bit_exact_outside_the_default_group():
    """Trainer (rank 0) and two receivers on real gloo, as threads of this process: the weights arrive bit-exact
    in mixed dtypes, twice (the second reusing the plan), and no default process group is created."""
    import threading

    import torch.distributed as dist

    from openk2.rl.ckpt_engine import CheckpointEngine, copy_into
    from openk2.rl.sync_group import StandaloneGroup, open_store

    torch.manual_seed(0)
    versions = [{"a": torch.randn(300, 7), "b": torch.randn(64).bfloat16(), "c": torch.arange(10)} for _ in range(2)]
    store = open_store("127.0.0.1", 3, timeout_s=30)
    received: dict[int, list[dict]] = {1: [], 2: []}
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            group = StandaloneGroup("127.0.0.1", store.port, rank, 3, timeout_s=30, store=store if rank == 0 else None)
            engine = CheckpointEngine(bucket_bytes=1024, group=group)
            for state in versions:
                mine = {k: torch.full_like(v, -1) for k, v in state.items()}
                engine.broadcast(state if rank == 0 else {}, copy_into(mine))
                if rank:
                    received[rank].append(mine)
        except BaseException as err:  # reported by the main thread
            errors.append(err)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert not dist.is_initialized()  # QK-Clip and ZeRO still see a single process
    for rank in (1, 2):
        for state, got in zip(versions, received[rank], strict=True):
            for k, v in state.items():
                assert got[k].dtype == v.dtype and torch.equal(got[k], v), (rank, k)


def test_trainer_import_does_not_import_ray():
    code = "import sys, openk2.rl.trainer; sys.exit('ray' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


# ---------------------------------------------------------------------- real Ray workers


def _run(tmp: Path, config: Path, extra: list[str], keep_open: bool = False):
    import ray

    from openk2.rl.trainer import RLTrainer

    trainer = RLTrainer(load_rl_config(config, MICRO + extra), tmp)
    start_digest = state_digest(trainer.policy)
    start_weights = {k: v.clone() for k, v in trainer.policy.state_dict().items()}
    trained: list = []  # the token ids and sampling log-probs of every group the loss saw, in order
    train = trainer._train

    tool_turns: list = []  # each trained tool episode: (turns, tokens the environment wrote, routing complete)

    def spy(groups):
        trained.append([(g.group_id, [(t.token_ids, t.logprobs) for t in g.trajectories]) for g in groups])
        tool_turns.extend((t.turns, t.mask.count(0), len(t.routing) == expected_rows(t))
                          for g in groups if g.env == "lookup" for t in g.trajectories)
        return train(groups)

    trainer._train = spy
    start = time.perf_counter()
    records = [trainer.iterate() for _ in range(ITERATIONS)]
    seconds = time.perf_counter() - start
    run = {"records": records, "start": start_digest, "policy": state_digest(trainer.policy),
           "weights": {k: v.clone() for k, v in trainer.policy.state_dict().items()}, "start_weights": start_weights,
           "inference": state_digest(trainer.inference), "seconds": seconds, "trained": trained,
           "paused": [[t.token_ids for t in g.trajectories] for g in trainer.rollout.paused],
           "workers": trainer.placement.digests() if extra else [], "tool_turns": tool_turns,
           "driver_node": ray.get_runtime_context().get_node_id(),
           "worker_nodes": sorted(ray.util.placement_group_table(trainer.placement.group)["bundles_to_node_id"]
                                  .values()) if extra else []}
    if keep_open:
        return run, trainer
    trainer.close()
    return run


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install -e '.[ray]')")
    from ray.cluster_utils import Cluster

    threads = torch.get_num_threads()
    # two Ray nodes on this machine: the head, where this driver (the trainer) runs, offers no CPU, so the rollout
    # workers' bundles can only be placed on the second node (its own raylet and object store)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    cluster.add_node(num_cpus=2)
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        root = tmp_path_factory.mktemp("ray")
        config = root / "mixture.toml"
        config.write_text(MIXTURE.format(base=CONFIG.as_posix()))
        colocated = _run(root / "colocated", config, [])
        one = _run(root / "ray1", config, ["rollout.placement='ray'"])
        two, trainer = _run(root / "ray2", config, ["rollout.placement='ray'", "rollout.num_workers=2"],
                            keep_open=True)
        yield {"colocated": colocated, "ray1": one, "ray2": two, "trainer": trainer, "head": cluster.head_node.node_id}
        trainer.close()
    finally:
        ray.shutdown()
        cluster.shutdown()
        torch.set_num_threads(threads)


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _check_run(ref: dict, got: dict, exact: tuple[str, ...], close: tuple[str, ...]) -> None:
    assert ref["start"] == got["start"]  # the same warm-up
    assert ref["trained"] and all(batch for batch in ref["trained"])
    assert any(r.get("updates") for r in ref["records"]) and ref["policy"] != ref["start"]  # not vacuous: it trained
    assert any(r["paused"] for r in ref["records"]) and any(r["resumed"] for r in ref["records"])  # partial rollout
    assert any(turns > 1 and written for turns, written, _ in ref["tool_turns"])  # multi-turn, with tool text
    assert all(complete for _, _, complete in ref["tool_turns"])  # R3 records (the monitor is on), from the workers
    assert got["tool_turns"] == ref["tool_turns"]
    for i, (a, b) in enumerate(zip(ref["records"], got["records"], strict=True)):
        for key in exact + TOOL_KEYS:
            assert _same(a.get(key, math.nan), b.get(key, math.nan)), (i, key, a.get(key), b.get(key))
        for key in close:
            if key in a:
                assert math.isclose(a[key], b[key], rel_tol=1e-3, abs_tol=1e-6), (i, key, a[key], b[key])
    assert got["inference"] == got["policy"]  # the driver's copy got the last update,
    assert got["workers"] == [got["policy"]] * len(got["workers"])  # and so did every worker, bit-exact
    assert all(r["sync_gb_s"] > 0 for r in got["records"] if "sync_s" in r)


@pytest.mark.slow
def test_one_ray_worker_equals_colocated_bit_for_bit(runs):
    """One worker runs the same engine batches as the colocated loop: every number and weight is identical."""
    _check_run(runs["colocated"], runs["ray1"], exact=KEYS, close=())
    assert runs["ray1"]["trained"] == runs["colocated"]["trained"]  # tokens and log-probs, exactly
    assert runs["ray1"]["policy"] == runs["colocated"]["policy"]


@pytest.mark.slow
def test_two_ray_workers_equal_colocated_within_rounding(runs):
    """Two workers sample the same tokens (per-request seeds), but each engine batches fewer sequences, and an
    fp32 CPU matmul's rounding depends on the batch shape: the sampling log-probs (pi_old), and through them the
    loss and the weights, differ slightly (loss to 1e-3 relative). Tokens, rewards and counts stay identical."""
    ref, got = runs["colocated"], runs["ray2"]
    _check_run(ref, got, exact=KEYS[:7], close=("loss", "entropy", "response_len"))
    assert got["paused"] == ref["paused"]  # the trajectories left paused, token for token
    assert len(got["trained"]) == len(ref["trained"])
    for mine, theirs in zip(got["trained"], ref["trained"], strict=True):  # each training batch:
        assert [(gid, [t for t, _ in trajs]) for gid, trajs in mine] == \
            [(gid, [t for t, _ in trajs]) for gid, trajs in theirs]  # the same groups and tokens, in order
        logp = torch.tensor([x for _, trajs in mine for _, lp in trajs for x in lp])
        logp_ref = torch.tensor([x for _, trajs in theirs for _, lp in trajs for x in lp])
        assert torch.allclose(logp, logp_ref, rtol=0, atol=1e-4)  # pi_old: rounding apart
    update = torch.cat([(w - ref["start_weights"][n]).flatten() for n, w in ref["weights"].items()])
    apart = torch.cat([(w - got["weights"][n]).flatten() for n, w in ref["weights"].items()])
    # measured: |w_ray2 - w_colocated| / |w_colocated - w_start| = 0.35% after 3 iterations (max element 8e-5
    # against a largest update of 6e-4); Muon's orthogonalised step spreads last-bit gradient differences
    assert float(apart.norm() / update.norm()) < 0.02


@pytest.mark.slow
def test_workers_run_on_another_ray_node_and_the_weight_sync_crosses_it(runs):
    """The trainer (this driver) is on the head node, every rollout worker on the second node; the gloo weight
    sync between them delivered every update bit-exact (_check_run compares the workers' digests)."""
    for name in ("ray1", "ray2"):
        run = runs[name]
        assert run["driver_node"] == runs["head"]
        assert len(run["worker_nodes"]) == (1 if name == "ray1" else 2)
        assert runs["head"] not in run["worker_nodes"]
        assert run["workers"] == [run["policy"]] * len(run["workers"])


@pytest.mark.slow
def test_killed_worker_is_a_one_line_error_not_a_hang(runs):
    trainer = runs["trainer"]
    os.kill(trainer.placement.pids[0], signal.SIGKILL)  # a real crash: the actor's process is gone
    for phase in (lambda: trainer.placement.sync(trainer.policy.state_dict()), trainer.iterate):
        start = time.perf_counter()
        with pytest.raises(RolloutWorkerError) as err:
            phase()
        assert time.perf_counter() - start < 30  # far below rollout.worker_timeout_s = 60: noticed, not timed out
        message = str(err.value)
        assert "\n" not in message and "worker 0" in message and "failed" in message, message
    import threading

    assert not [t for t in threading.enumerate() if t.name == "weight-sync"]  # the sync's sender thread unwound
