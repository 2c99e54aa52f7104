"""The pipeline's stages: what each one reads, where it writes, how it runs, and how it records that it finished.

    tokenizer -> pretrain -> eval-pretrain
                        \\-> sft -> eval-sft
                                \\-> rl -> eval-rl

Every stage works in its own directory under the pipeline's `out_dir` and ends by writing `DONE` there
(atomically, last): a JSON manifest with the stage's config fingerprint, its wall and CPU time, and its key
outputs. A stage with a `DONE` is skipped. A stage without one runs; the training stages then resume from their
newest complete checkpoint (`--resume` of `openk2 pretrain`, `openk2 sft`, `openk2 rl`), and the evaluation
stages from the harness's per-sample records.

The training stages run their own command's entry point in-process (`openk2.cli.pretrain.pretrain_main`,
`openk2.cli.sft.sft_main`, `openk2.cli.rl.rl_main`) on a run file the stage writes first, `stage.toml`:
the stage's config with its `set` table and the pipeline's keys (run directory, tokenizer, init checkpoint,
threads) applied. `openk2 sft --config <out>/sft/stage.toml --resume` therefore repeats a stage by hand.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from openk2.fileio import atomic_write_text
from openk2.pipeline import toml_writer
from openk2.pipeline.config import PipelineConfig
from openk2.train.checkpoint import CheckpointManager

if TYPE_CHECKING:
    from openk2.rl.config import RLConfig
    from openk2.train.config import RunConfig

DONE_FILE = "DONE"
LOG_FILE = "pipeline.jsonl"  # one JSON line per stage attempt, in the pipeline directory
STAGE_CONFIG = "stage.toml"
TASK_DATA_FILE = "task_train.jsonl"


class StageStopped(RuntimeError):
    """A training stage returned before its last step (Ctrl-C / SIGTERM): its checkpoint is kept for resuming."""


@dataclass
class Stage:
    """One step of the pipeline. `body()` does the work in `directory` and returns the numbers to record."""

    name: str
    directory: Path
    inputs: tuple[str, ...]  # stages whose outputs this one reads
    fingerprint: str  # hash of everything in the config that this stage's output depends on
    body: Callable[[], dict[str, Any]]

    @property
    def done_path(self) -> Path:
        return self.directory / DONE_FILE

    def manifest(self) -> dict[str, Any] | None:
        """The `DONE` manifest, or None while the stage has not finished."""
        if not self.done_path.is_file():
            return None
        return json.loads(self.done_path.read_text())

    def mark_done(self, wall_s: float, cpu_s: float, info: dict[str, Any]) -> dict[str, Any]:
        record = {"stage": self.name, "fingerprint": self.fingerprint, "wall_s": wall_s, "cpu_s": cpu_s,
                  "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "info": info}
        write_json_atomic(self.done_path, record)
        return record

    def reset(self) -> None:
        """Forget everything the stage produced (its directory), so it runs from scratch."""
        shutil.rmtree(self.directory, ignore_errors=True)


def write_json_atomic(path: Path, record: dict[str, Any]) -> None:
    atomic_write_text(path, json.dumps(record, indent=2, default=str) + "\n")


def latest_checkpoint(run_dir: Path) -> Path | None:
    return CheckpointManager(run_dir / "checkpoints").latest()


def _fingerprint(spec: Any) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _with_threads(raw: dict[str, Any], threads: int) -> dict[str, Any]:
    if threads:
        raw.setdefault("train", {})["threads"] = threads
    return raw


def _write_stage_config(directory: Path, raw: dict[str, Any]) -> Path:
    return atomic_write_text(directory / STAGE_CONFIG, toml_writer.dumps(raw))


def _finished(directory: Path, stage: str, total: int) -> Path:
    """The stage's final checkpoint; an error if the run stopped before `total` (e.g. on Ctrl-C)."""
    latest = latest_checkpoint(directory)
    expected = CheckpointManager(directory / "checkpoints").path_for(total).name
    if latest is None or latest.name != expected:
        raise StageStopped(f"stage {stage} stopped before step {total} (newest checkpoint: {latest}); "
                           f"run the pipeline again to resume it")
    return latest


def _resume_args(directory: Path) -> tuple[list[str], str | None]:
    latest = latest_checkpoint(directory)
    return (["--resume"], latest.name) if latest is not None else ([], None)


def _run_training_command(stage: str, directory: Path, raw: dict[str, Any], entry: Callable[[list[str]], int],
                          total: int) -> dict[str, Any]:
    """Save `raw` as the stage's run file and run the command's entry point on it, with `--resume` when the
    directory holds a complete checkpoint; the run must end at step `total`."""
    path = _write_stage_config(directory, raw)
    resume, resumed_from = _resume_args(directory)
    code = entry(["--config", str(path), *resume])
    if code != 0:
        raise RuntimeError(f"stage {stage} exited with status {code}")
    return {"checkpoint": str(_finished(directory, stage, total)), "resumed_from": resumed_from}


# ------------------------------------------------------------------------------------------------ the stages
def build_stages(cfg: PipelineConfig, out_dir: str | Path) -> list[Stage]:
    """The stages of `cfg` in run order. Every stage config is parsed here, so a bad key fails before any work."""
    from openk2.rl.config import RLConfig
    from openk2.train.config import RunConfig

    out = Path(out_dir)
    dirs = {name: out / name for name in ("tokenizer", "pretrain", "sft", "rl")}
    threads = cfg.threads

    pretrain_raw = cfg.stage_raw("pretrain")
    pretrain_raw.setdefault("model", {})["vocab_size"] = cfg.tokenizer.vocab_size
    pretrain_raw.setdefault("tokenizer", {})["path"] = str(dirs["tokenizer"])
    pretrain_raw["out_dir"] = str(dirs["pretrain"])
    with cfg.stage_errors("pretrain"):
        pretrain_cfg = RunConfig.from_dict(copy.deepcopy(pretrain_raw))

    sft_raw = cfg.stage_raw("sft")
    sft_raw.setdefault("sft", {})["init_from"] = str(dirs["pretrain"])
    sft_raw["out_dir"] = str(dirs["sft"])
    if "data" in pretrain_raw:  # sft.pretrain_fraction mixes in the corpus the model was pre-trained on
        sft_raw["data"] = copy.deepcopy(pretrain_raw["data"])
    if cfg.sft.task_examples:
        files = list(sft_raw["sft"].get("train_files", []))
        sft_raw["sft"]["train_files"] = [*files, str(dirs["sft"] / TASK_DATA_FILE)]
    with cfg.stage_errors("sft"):  # validates; the model comes from pretrain
        sft_steps = RunConfig.from_dict(copy.deepcopy(sft_raw)).train.steps

    rl_raw = cfg.stage_raw("rl")
    rl_raw.pop("model", None)  # replaced by the SFT checkpoint when the stage runs
    rl_raw["out_dir"] = str(dirs["rl"])
    with cfg.stage_errors("rl"):
        rl_cfg = RLConfig.from_dict(copy.deepcopy(rl_raw))

    def tokenizer_body() -> dict[str, Any]:
        from openk2.data.corpus import tokenizer_training_texts
        from openk2.data.tokenizer import train_tokenizer

        texts = tokenizer_training_texts(pretrain_cfg.data, cfg.tokenizer.train_chars)
        tokenizer = train_tokenizer(texts, cfg.tokenizer.vocab_size)
        tokenizer.save(dirs["tokenizer"])
        return {"vocab_size": tokenizer.vocab_size, "bpe_tokens": tokenizer.num_base_tokens,
                "train_chars": sum(len(t) for t in texts)}

    def pretrain_body() -> dict[str, Any]:
        from openk2.cli.pretrain import pretrain_main

        raw = _with_threads(copy.deepcopy(pretrain_raw), threads)
        return _run_training_command("pretrain", dirs["pretrain"], raw, pretrain_main, pretrain_cfg.train.steps)

    def sft_body() -> dict[str, Any]:
        from openk2.cli.sft import sft_main

        if cfg.sft.task_examples:
            from openk2.pipeline.task_data import write_task_conversations

            write_task_conversations(dirs["sft"] / TASK_DATA_FILE, rl_cfg, cfg.sft.task_examples)
        raw = _with_threads(copy.deepcopy(sft_raw), threads)
        return _run_training_command("sft", dirs["sft"], raw, sft_main, sft_steps)

    def rl_body() -> dict[str, Any]:
        from openk2.cli.rl import rl_main

        policy = latest_checkpoint(dirs["sft"])
        if policy is None:
            raise RuntimeError(f"stage rl needs an SFT checkpoint in {dirs['sft']}")
        raw = _with_threads(copy.deepcopy(rl_raw), threads)
        raw["model"] = {"checkpoint": str(policy)}
        info = _run_training_command("rl", dirs["rl"], raw, rl_main, rl_cfg.train.iterations)
        return {**info, "init_from": str(policy)}

    specs = _fingerprint_specs(cfg, pretrain_cfg, rl_cfg)
    stages = [
        Stage("tokenizer", dirs["tokenizer"], (), _fingerprint(specs["tokenizer"]), tokenizer_body),
        Stage("pretrain", dirs["pretrain"], ("tokenizer",), _fingerprint(specs["pretrain"]), pretrain_body),
        Stage("sft", dirs["sft"], ("pretrain",), _fingerprint(specs["sft"]), sft_body),
        Stage("rl", dirs["rl"], ("sft",), _fingerprint(specs["rl"]), rl_body),
    ]
    for trained in cfg.eval.after:  # each evaluation right after the stage it evaluates
        index = next(i for i, s in enumerate(stages) if s.name == trained) + 1
        stages.insert(index, _eval_stage(cfg, out, trained, dirs[trained]))
    return stages


def _fingerprint_specs(cfg: PipelineConfig, pretrain_cfg: RunConfig, rl_cfg: RLConfig) -> dict[str, Any]:
    """What each training stage's output depends on: its config as the user wrote it, before the pipeline adds
    its paths (so a moved pipeline directory keeps its fingerprints) and without `train.threads` (speed only)."""

    def user_config(name: str) -> dict[str, Any]:
        raw = cfg.stage_raw(name)
        raw.get("train", {}).pop("threads", None)
        if name == "rl":
            raw.pop("model", None)
        return raw

    synth_files = user_config("sft").get("sft", {}).get("synth_files", [])
    return {
        "tokenizer": {"tokenizer": dataclasses.asdict(cfg.tokenizer), "data": pretrain_cfg.data.to_dict()},
        "pretrain": {"run": user_config("pretrain"), "vocab_size": cfg.tokenizer.vocab_size},
        "sft": {"run": user_config("sft"), "task_examples": cfg.sft.task_examples,
                "task": dataclasses.asdict(rl_cfg.task) if cfg.sft.task_examples else None,
                **({"synth": _synth_digests(synth_files)} if synth_files else {})},
        "rl": {"run": user_config("rl")},
    }


def _synth_digests(paths: list[str]) -> list[str | None]:
    """A hash of each synthesized-data file the SFT stage reads (a synthesis run that grew is new data)."""
    digests = []
    for path in paths:
        file = Path(path) / "sft.jsonl" if Path(path).is_dir() else Path(path)  # openk2.train.sft_mixture.synth_file
        digests.append(hashlib.sha256(file.read_bytes()).hexdigest()[:16] if file.is_file() else None)
    return digests


def _eval_stage(cfg: PipelineConfig, out: Path, trained: str, trained_dir: Path) -> Stage:
    ec = cfg.eval
    directory = out / f"eval-{trained}"

    def body() -> dict[str, Any]:
        import torch

        from openk2.eval.base import EvalContext
        from openk2.eval.harness import run_eval

        checkpoint = latest_checkpoint(trained_dir)
        if checkpoint is None:
            raise RuntimeError(f"stage eval-{trained} needs a checkpoint in {trained_dir}")
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        ctx = EvalContext(seed=ec.seed, temperature=ec.temperature, max_tokens=ec.max_tokens)
        results = run_eval(f"local:{checkpoint}", ec.benchmarks, directory, limit=ec.limit or None, ctx=ctx,
                           concurrency=ec.concurrency)
        return {"model": str(checkpoint),
                "results": {name: dataclasses.asdict(agg) for name, agg in results.items()}}

    spec = {k: v for k, v in dataclasses.asdict(ec).items() if k not in ("after", "concurrency")}
    return Stage(f"eval-{trained}", directory, (trained,), _fingerprint(spec), body)


def downstream(stages: list[Stage], names: set[str]) -> set[str]:
    """`names` and every stage that reads, directly or not, from one of them."""
    closed = set(names)
    for stage in stages:  # run order is a topological order
        if any(i in closed for i in stage.inputs):
            closed.add(stage.name)
    return closed


__all__ = ["DONE_FILE", "STAGE_CONFIG", "Stage", "StageStopped", "build_stages", "downstream", "latest_checkpoint",
           "write_json_atomic"]
