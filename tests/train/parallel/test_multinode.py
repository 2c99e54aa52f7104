"""Multi-node as users launch it: two torchrun agents on this machine (`--nnodes 2`, 2 processes each, a c10d
rendezvous on 127.0.0.1) run `openk2 pretrain` at pp2 x dp2 and equal the single-process run of the same batch.

The agents are separate launcher processes that meet only through the rendezvous endpoint, as two nodes would;
the 4 workers then form one gloo world. pp2 x dp2: 2 data ranks x batch_size 1 x grad_accum 2 = the single
run's 4 rows. The SLURM recipe that runs this command per node is examples/slurm/pretrain.sbatch.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import tomli_w

from openk2.train.config import RunConfig
from openk2.train.trainer import Trainer
from tests.train.parallel.runs import assert_same_run, micro_run

STEPS = 2
LAYOUT = {"pp": 2, "dp": 2, "pp_virtual_stages": 2, "pp_schedule": "interleaved_1f1b"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_torchrun_agents_with_c10d_rendezvous_match_single_process(tmp_path, micro_tokenizer_dir, monkeypatch):
    monkeypatch.setattr("openk2.train.trainer.plot_run", lambda run_dir: [])
    single, multi = tmp_path / "single", tmp_path / "two-nodes"
    Trainer(RunConfig.from_dict(micro_run(micro_tokenizer_dir, single, {}, 4, 1, STEPS))).run()
    config = tmp_path / "two-nodes.toml"
    config.write_text(tomli_w.dumps(micro_run(micro_tokenizer_dir, multi, LAYOUT, 1, 2, STEPS)))
    endpoint = f"127.0.0.1:{_free_port()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
         "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "openk2-test",
         "-m", "openk2", "pretrain", "--config", str(config)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for node in (0, 1)]
    try:
        outputs = [agent.communicate(timeout=900) for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
    for agent, (_, err) in zip(agents, outputs, strict=True):
        assert agent.returncode == 0, err[-4000:]
    assert sum(out.count("run directory") for out, _ in outputs) == 1  # one rank 0 in the whole job
    assert_same_run(multi, single, STEPS)
