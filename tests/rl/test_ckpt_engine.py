"""Checkpoint engine: bucket plans, and real gloo processes whose receivers end bit-identical to the senders."""

import pytest
import torch
from safetensors.torch import save_file

from openk2.config import ModelConfig
from openk2.model import K2ForCausalLM
from openk2.rl.ckpt_engine import (
    CheckpointEngine,
    TensorMeta,
    assign_readers,
    copy_into,
    load_and_broadcast,
    plan_buckets,
    safetensors_index,
    sync_in_process,
)
from tests.train.parallel.ranks import run_ranks

BUCKET = 96 << 10  # small buckets: many of them, so the double-buffered pipeline really alternates


def _tiny_model(seed: int) -> K2ForCausalLM:
    torch.manual_seed(seed)
    cfg = ModelConfig.preset("tiny").replace(vocab_size=512, num_hidden_layers=2, n_routed_experts=4)
    return K2ForCausalLM(cfg)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


# ---------------------------------------------------------------------- plans (no processes)
def test_plan_keeps_owners_apart_and_caps_bucket_size():
    metas = [TensorMeta(f"w{i}", (100,), torch.float32, owner=i % 2) for i in range(10)]
    metas.append(TensorMeta("big", (5000,), torch.bfloat16, owner=1))
    plan = plan_buckets(metas, bucket_bytes=1024)
    assert sorted(m.name for b in plan for m, _ in b.entries) == sorted(m.name for m in metas)
    for bucket in plan:
        assert {m.owner for m, _ in bucket.entries} == {bucket.owner}
        assert bucket.nbytes <= 1024 or len(bucket.entries) == 1  # only an oversize tensor travels alone
        assert all(offset % 64 == 0 for _, offset in bucket.entries)
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets(metas, bucket_bytes=8)


def test_in_process_sync_is_bit_exact():
    src, dst = _tiny_model(0), _tiny_model(1)
    stats = sync_in_process(dict(src.state_dict()), dict(dst.state_dict()), bucket_bytes=BUCKET)
    assert stats.num_buckets > 10
    for (name, a), b in zip(src.state_dict().items(), dst.state_dict().values(), strict=True):
        assert torch.equal(_bits(a), _bits(b)), name


def test_readers_are_disjoint_and_balanced():
    index = {f"t{i}": (None, (i,), torch.float32, 4 * (i + 1)) for i in range(20)}
    owner = assign_readers(index, 3)
    assert set(owner) == set(index)
    loads = [sum(index[k][3] for k, r in owner.items() if r == rank) for rank in range(3)]
    assert max(loads) - min(loads) <= max(v[3] for v in index.values())


# ---------------------------------------------------------------------- real processes
WORLD = 3  # ranks 0 and 1 are trainers holding shards; rank 2 only receives


def _worker(rank: int, ckpt: str) -> dict:
    """One rank of the gloo group (run_ranks has joined it): what it sent, received and read, keyed by rank."""
    out = {}
    engine = CheckpointEngine(bucket_bytes=BUCKET)
    # Weight updates: two of them, the second reusing the plan and overwriting everything.
    for version in range(2):
        state = _tiny_model(100 + version).state_dict()
        state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"].bfloat16()  # mixed dtypes
        names = list(state)
        shard = {n: state[n] for i, n in enumerate(names) if i % 2 == rank} if rank < 2 else {}
        inference = {n: torch.full_like(t, float("nan")) for n, t in state.items()}
        stats = engine.broadcast(shard, copy_into(inference))
        out[(rank, version, "identical")] = all(torch.equal(_bits(state[n]), _bits(inference[n])) for n in names)
        out[(rank, version, "stats")] = (stats.num_buckets, stats.bytes)
    # Startup: each rank reads a disjoint part of the checkpoint; everyone receives all of it.
    received: dict[str, torch.Tensor] = {}
    keys = load_and_broadcast(ckpt, engine, lambda name, t: received.__setitem__(name, t.clone()))
    out[(rank, "read")] = keys
    out[(rank, "received")] = {k: _bits(v) for k, v in received.items()}
    return out


@pytest.mark.slow
def test_gloo_update_and_startup_are_bit_exact(tmp_path):
    model = _tiny_model(7)
    model.save_pretrained(tmp_path, max_shard_bytes=2 << 20)  # several shards
    from safetensors import safe_open

    expected = {}
    for file in sorted(tmp_path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            expected.update({k: _bits(f.get_tensor(k)) for k in f.keys()})
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    results = {key: value for out in run_ranks(WORLD, _worker, str(tmp_path)).values() for key, value in out.items()}

    reference = _tiny_model(0)
    expected_bytes = sum(t.nbytes for t in reference.state_dict().values()) - \
        reference.model.embed_tokens.weight.nbytes // 2  # the embedding travels in bf16
    for rank in range(WORLD):
        for version in range(2):
            assert results[(rank, version, "identical")], (rank, version)
            num_buckets, num_bytes = results[(rank, version, "stats")]
            assert num_buckets > 10 and num_bytes == expected_bytes
    read = [set(results[(r, "read")]) for r in range(WORLD)]
    assert set().union(*read) == set(expected) and sum(map(len, read)) == len(expected)  # each read once
    assert all(read)  # every rank did part of the reading
    for rank in range(WORLD):
        got = results[(rank, "received")]
        assert got.keys() == expected.keys()
        assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_safetensors_index_reads_headers(tmp_path):
    save_file({"a": torch.zeros(3, 4), "b": torch.ones(2, dtype=torch.bfloat16)}, str(tmp_path / "x.safetensors"))
    index = safetensors_index(tmp_path)
    assert index["a"][1:] == ((3, 4), torch.float32, 48)
    assert index["b"][1:] == ((2,), torch.bfloat16, 4)
    with pytest.raises(ValueError, match="no .safetensors"):
        safetensors_index(tmp_path / "missing")
