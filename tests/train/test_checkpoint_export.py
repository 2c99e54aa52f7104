"""`openk2 export`: HF safetensors streamed from a checkpoint's DCP shards equal what save_pretrained wrote."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from openk2.cli import main
from openk2.train.config import RunConfig
from openk2.train.hf_export import export_hf
from openk2.train.trainer import Trainer


@pytest.fixture
def checkpoint(micro_raw, tmp_path):
    return Trainer(RunConfig.from_dict(micro_raw), out_dir=tmp_path / "r").run(max_steps=2).checkpoint


def test_export_equals_save_pretrained_and_loads_in_transformers(checkpoint, tmp_path):
    assert main(["export", "--checkpoint", str(tmp_path / "r"), "--out", str(tmp_path / "hf")]) == 0
    got, want = load_file(tmp_path / "hf" / "model.safetensors"), load_file(checkpoint / "model.safetensors")
    assert got.keys() == want.keys() and any(".experts.7.down_proj.weight" in k for k in got)
    for key, value in want.items():
        assert torch.equal(got[key], value), key
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    transformers = pytest.importorskip("transformers")
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    from openk2 import K2ForCausalLM

    ours = K2ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ids = torch.randint(0, 768, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids).logits, rtol=1e-5, atol=1e-5)


def test_export_streams_in_small_reads_shards_and_casts(checkpoint, tmp_path):
    """A 1-byte budget reads one expert row at a time; a 64 KB file limit splits the export into shards."""
    files = export_hf(checkpoint, tmp_path / "bf16", dtype=torch.bfloat16, max_shard_bytes=64 << 10, budget=1)
    assert len(files) > 1 and (tmp_path / "bf16" / "model.safetensors.index.json").is_file()
    got = {k: v for f in files for k, v in load_file(f).items()}
    want = load_file(checkpoint / "model.safetensors")
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key].dtype == torch.bfloat16 and torch.equal(got[key], value.to(torch.bfloat16)), key


def test_export_errors_are_one_line(tmp_path, capsys):
    assert main(["export", "--checkpoint", str(tmp_path / "none"), "--out", str(tmp_path / "o")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["export", "--checkpoint", str(tmp_path / "empty"), "--out", str(tmp_path / "o")]) == 2
    assert "incomplete or corrupt" in capsys.readouterr().err
