"""The supervised warm-up before RL: teach a fresh tiny policy the task's prompt/answer format.

RL only sharpens what a policy can already sample (the K2 report starts RL from its SFT model); a randomly
initialised model never writes "Answer: <n>", so every reward would be 0. The warm-up generates seeded,
worked solutions of arithmetic problems in the K2 chat format,

    <|im_system|>system<|im_middle|>You are Kimi, ...<|im_end|><|im_user|>user<|im_middle|>Compute 3+5*2.
    Finish with a last line of the form "Answer: <your answer>".<|im_end|><|im_assistant|>assistant<|im_middle|>
    5*2=10
    3+10=13
    Answer: 13<|im_end|>

trains a byte-level BPE on them, and fits the model with the loss on the assistant tokens only. Kept short on
purpose (`warmup.steps`): the policy should know the format but still make mistakes RL can fix.
"""

from __future__ import annotations

import re
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from tqdm import tqdm

from openk2.chat import ChatFormat, render
from openk2.chat.template import IM_END
from openk2.data.tokenizer import K2Tokenizer, train_tokenizer
from openk2.model import ForwardStats, K2ForCausalLM
from openk2.optim.muonclip import MuonClip
from openk2.optim.schedule import WSDConfig, wsd_lr
from openk2.rl.config import RLConfig
from openk2.rl.mixture import problems
from openk2.rl.tasks import Problem, Task
from openk2.rng import seed_everything

_TOKEN_RE = re.compile(r"\d+|[-+*]")
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
WARMUP_DIR = "warmup"
# One warm-up example as (text, trained on) runs: text written by openk2 itself (markers become control tokens)
Example = list[tuple[str, bool]]
# Called after every warm-up step with (steps done, model, tokenizer): True ends the warm-up there
StopRule = Callable[[int, K2ForCausalLM, K2Tokenizer], bool]


# ---------------------------------------------------------------------- the data
def worked_solution(expression: str) -> str:
    """Step-by-step evaluation of a `+ - *` integer expression (products first, then left to right), ending
    with the answer line; e.g. "3+5*2" -> "5*2=10\\n3+10=13\\nAnswer: 13"."""
    items: list = [int(t) if t.isdigit() else t for t in _TOKEN_RE.findall(expression)]
    if not items or len(items) % 2 == 0 or any(not isinstance(x, int) for x in items[::2]):
        raise ValueError(f"not a + - * expression of non-negative integers: {expression!r}")
    lines = []
    for ops in ("*", "+-"):
        i = 1
        while i < len(items):
            if items[i] in ops:
                a, op, b = items[i - 1: i + 2]
                items[i - 1: i + 2] = [_OPS[op](a, b)]
                lines.append(f"{a}{op}{b}={items[i - 1]}")
            else:
                i += 2
    return "\n".join([*lines, f"Answer: {items[0]}"])


def chat_prompt(problem: Problem) -> str:
    """The K2 chat rendering of a problem, ending with the assistant's generation prompt."""
    return render([{"role": "user", "content": problem.prompt}])


def encode_prompt(tokenizer: K2Tokenizer, problem: Problem) -> list[int]:
    """The rollout prompt's token ids (K2's chat format, one user turn)."""
    return ChatFormat(tokenizer).prepare([{"role": "user", "content": problem.prompt}]).token_ids


def sft_text(problem: Problem) -> tuple[str, str]:
    """(prompt text, target text) of one warm-up example: the worked solution, then the end-of-turn token."""
    return chat_prompt(problem), worked_solution(problem.data["expression"]) + IM_END


def sft_example(problem: Problem) -> Example:
    """The arithmetic warm-up example: the prompt (not trained on), then the worked solution (trained on)."""
    prompt, target = sft_text(problem)
    return [(prompt, False), (target, True)]


def sft_batch(tokenizer: K2Tokenizer, batch: list[Problem],
              example: Callable[[Problem], Example] = sft_example) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids [B, T] right-padded with [PAD] and labels [B, T] (-100 outside the targets)."""
    rows = []
    for problem in batch:
        ids: list[int] = []
        labels: list[int] = []
        for text, trained in example(problem):
            run = tokenizer.encode(text, allow_special=True)
            ids += run
            labels += run if trained else [-100] * len(run)
        rows.append((ids, labels))
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for b, (row_ids, row_labels) in enumerate(rows):
        ids[b, : len(row_ids)] = torch.tensor(row_ids)
        labels[b, : len(row_labels)] = torch.tensor(row_labels)
    return ids, labels


# ---------------------------------------------------------------------- the run
def run_warmup(cfg: RLConfig, task: Task, out_dir: Path, exclude: set[str],
               difficulties: list[int] | None = None, stream: Iterator[Problem] | None = None,
               example: Callable[[Problem], Example] = sft_example,
               stop: StopRule | None = None) -> tuple[K2ForCausalLM, K2Tokenizer]:
    """Train (or reload, when `out_dir/warmup` holds a finished one) the warmed-up policy and its tokenizer, on
    `task`'s problems at `difficulties` (default: [task] difficulties) minus the `exclude`d held-out prompts, or
    on the problems of `stream` when given, each written out by `example`; `stop(step, model, tokenizer)` after
    each step may end it before `warmup.steps` (rl/tool_warmup.py's probe)."""
    done = out_dir / WARMUP_DIR
    if (done / "config.json").is_file() and (done / "tokenizer.json").is_file():
        print(f"warm-up: reusing {done}", file=sys.stderr)
        return K2ForCausalLM.from_pretrained(done, dtype=torch.float32), K2Tokenizer.load(done)
    wc = cfg.warmup
    seed = cfg.train.seed
    if stream is None:
        stream = problems(task, difficulties or cfg.task.difficulties, seed + 1, exclude)
    texts = ["".join(text for text, _ in example(next(stream))) for _ in range(wc.tokenizer_examples)]
    tokenizer = train_tokenizer(texts, cfg.model.vocab_size)
    seed_everything(seed)  # the policy's initial weights
    model = K2ForCausalLM(cfg.model)
    if wc.steps:
        _fit(model, tokenizer, stream, cfg, example, stop)
    tmp = out_dir / f".{WARMUP_DIR}-tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(done, ignore_errors=True)  # an incomplete earlier attempt
    model.save_pretrained(tmp)
    tokenizer.save(tmp)
    tmp.replace(done)  # atomic: a crash mid-write leaves no half-written warm-up to be reused
    return model, tokenizer


def _fit(model: K2ForCausalLM, tokenizer: K2Tokenizer, stream: Iterator[Problem], cfg: RLConfig,
         example: Callable[[Problem], Example] = sft_example, stop: StopRule | None = None) -> None:
    wc = cfg.warmup
    optimizer = MuonClip(model, lr=wc.lr, weight_decay=0.0, tau=cfg.optim.qk_clip_tau,
                         use_muon=cfg.optim.optimizer != "adamw")  # an sgd RL run still warms up with Muon
    warm = max(1, wc.steps // 10)
    decay = wc.steps // 3
    schedule = WSDConfig(peak_lr=wc.lr, warmup_steps=warm, stable_steps=wc.steps - warm - decay,
                         decay_steps=decay, decay_floor=wc.lr * 0.1)
    model.train()
    bar = tqdm(range(wc.steps), desc="warm-up", unit="step", dynamic_ncols=True, disable=None)
    for step in bar:
        optimizer.set_lr(wsd_lr(step, schedule))
        ids, labels = sft_batch(tokenizer, [next(stream) for _ in range(wc.batch_size)], example)
        stats = ForwardStats(model.config, track_max_logits=True)
        loss = model(ids, labels=labels, stats=stats).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step(stats.max_logits())
        optimizer.zero_grad()
        if step % 10 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
        if stop is not None and stop(step + 1, model, tokenizer):
            break
    bar.close()


__all__ = ["Example", "StopRule", "chat_prompt", "encode_prompt", "problems", "run_warmup", "sft_batch", "sft_example",
           "sft_text", "worked_solution"]
