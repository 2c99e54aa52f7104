"""A rollout worker: one process holding an inference copy of the policy, fed weights by the checkpoint engine.

`RayPlacement` (rl/ray_placement.py) runs this class as a Ray actor. It joins the weight-sync process group
as a pure receiver (rank >= 1; the trainer is rank 0), receives every update with `CheckpointEngine.broadcast`
(the bytes travel over torch.distributed, never through Ray's object store), and runs `PartialRollout` on the
groups the trainer sends it, then plays the tool groups' episodes (rl/tool_rollout.py: the environments rebuilt
from their specs, every world from its problem, the tool calls executed here). It keeps no rollout state between
calls: the trainer owns the paused groups.
The class itself imports no Ray, so it can be read and tested as a plain object.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from openk2.config import ModelConfig
from openk2.data.tokenizer import K2Tokenizer
from openk2.model import K2ForCausalLM
from openk2.rl.ckpt_engine import CheckpointEngine, copy_into
from openk2.rl.rollout import Group, PartialRollout, RolloutStats
from openk2.rl.sync_group import StandaloneGroup
from openk2.rl.tool_rollout import ToolRollout, run_tool_groups


def tokenizer_files(tokenizer: K2Tokenizer) -> dict[str, bytes]:
    """The files `K2Tokenizer.save` writes, as bytes (a few KB to MB: small enough to ship as metadata)."""
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save(tmp)
        return {p.name: p.read_bytes() for p in Path(tmp).iterdir()}


def state_digest(model: torch.nn.Module) -> str:
    """sha256 over the names and raw bytes of `model`'s state dict (equal digests: bit-identical weights)."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class RolloutWorker:
    """An inference copy of the policy that receives weight updates and samples the groups it is given."""

    def __init__(self, model_config: ModelConfig, tokenizer: dict[str, bytes], rollout: PartialRollout, *,
                 inference_dtype: str = "fp32", device: str = "cpu", threads: int = 0,
                 tools: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        """`tools`: each tool environment's `ToolRollout.spec()` by environment name."""
        if threads:
            torch.set_num_threads(threads)
        self.device = torch.device(device)
        with tempfile.TemporaryDirectory() as tmp:
            for name, data in tokenizer.items():
                (Path(tmp) / name).write_bytes(data)
            self.tokenizer = K2Tokenizer.load(tmp)
        with torch.no_grad():  # random weights until the first update arrives
            self.model = K2ForCausalLM(model_config).to(self.device).eval()
        if inference_dtype == "bf16":
            self.model.to(torch.bfloat16)
        self.state = dict(self.model.state_dict())
        self.partial = rollout
        self.tools = {name: ToolRollout.from_spec(spec, self.tokenizer) for name, spec in (tools or {}).items()}
        self.group: StandaloneGroup | None = None
        self.engine: CheckpointEngine | None = None

    def pid(self) -> int:
        """This worker's process id (answers once the constructor has finished)."""
        return os.getpid()

    def join(self, host: str, port: int, rank: int, world_size: int, backend: str, bucket_bytes: int,
             timeout_s: float) -> int:
        """Join the weight-sync group at the trainer's store `host:port` (collective with the trainer and the
        other workers); returns the rank."""
        self.group = StandaloneGroup(host, port, rank, world_size, backend, timeout_s)
        self.engine = CheckpointEngine(bucket_bytes=bucket_bytes, group=self.group,
                                       device=self.device if backend == "nccl" else "cpu")
        return rank

    def receive(self) -> int:
        """Receive one weight update into the inference copy (collective); returns the bytes received."""
        assert self.engine is not None, "join() first"
        return self.engine.broadcast({}, copy_into(self.state)).bytes

    def rollout(self, groups: list[Group], iteration: int, version: int, temperature: float,
                tool_groups: list[Group] | None = None) -> tuple[list[Group], list[Group], RolloutStats]:
        """Run one rollout phase on `groups` (paused ones first, as the trainer orders them), then play
        `tool_groups` to their end; returns both, complete or paused, and the phase's stats (`new_tokens`
        counting the tool episodes' sampled tokens too)."""
        self.partial.paused = []
        _, stats = self.partial.run(self.model, self.tokenizer, groups, iteration=iteration, version=version,
                                    temperature=temperature)
        self.partial.paused = []
        tool_groups = list(tool_groups or [])
        tool_tokens = run_tool_groups(self.tools, tool_groups, self.model, iteration=iteration, version=version,
                                      temperature=temperature)
        stats.new_tokens += tool_tokens
        return groups, tool_groups, stats

    def digest(self) -> str:
        """`state_digest` of the inference copy."""
        return state_digest(self.model)



__all__ = ["RolloutWorker", "state_digest", "tokenizer_files"]
