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
from openk2.rl import tasks
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
        # A constructor's exception reaches the driver only as Ray's "the actor died ... in its creation task"
        # header line; raised from the first call instead (pid(), which the driver waits on), it arrives as itself.
        self.start_error: ValueError | None = None
        try:
            self.tools = {name: _rebuild(name, spec, self.tokenizer) for name, spec in (tools or {}).items()}
        except ValueError as err:
            self.tools, self.start_error = {}, err
        self.group: StandaloneGroup | None = None
        self.engine: CheckpointEngine | None = None

    def pid(self) -> int:
        """This worker's process id (answers once the constructor has finished; raises what it could not
        build)."""
        self._started()
        return os.getpid()

    def _started(self) -> None:
        if self.start_error is not None:
            raise self.start_error

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
        self._started()
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

    def tool_tasks(self) -> dict[str, str]:
        """Each tool environment's task as this worker rebuilt it: its class, 'module:qualname'."""
        return {name: f"{type(t.task).__module__}:{type(t.task).__qualname__}" for name, t in self.tools.items()}


def _rebuild(env: str, spec: Mapping[str, Any], tokenizer: K2Tokenizer) -> ToolRollout:
    """Tool environment `env` from its spec; a task this process cannot build is a one-line ValueError."""
    try:
        return ToolRollout.from_spec(spec, tokenizer)
    except ValueError as err:
        name = str(spec["task"])
        # the driver's config check (tasks.check_rebuildable) catches a register()ed name unless it was
        # registered after the config was loaded: say what is missing here, in one line
        hint = ("; a task registered (openk2.rl.tasks.register) only in the driver process does not exist in a "
                'rollout worker: name it by import path, task = "module:Factory"'
                if name not in tasks.names() and ":" not in name else "")
        raise ValueError(f"rollout worker: cannot rebuild tool environment {env!r}: {err}{hint}") from None


__all__ = ["RolloutWorker", "state_digest", "tokenizer_files"]
