"""Self-critique in `openk2 rl` (report 3.2.2): the critic's closed loop and the self-critique rubric reward as
entries of the `[[envs]]` mixture. The trainer calls the hooks of `CriticLoop`; the logic lives here.

Two kinds of entry:

- `task = "critic"` (compact prompt, `rl/critic_compact.py`) or `"critic-rubric"` (the rubric prompt): a
  `CriticEnv`, whose groups are the critic's own comparisons. Each iteration, before the training step, every
  trained group of a verifier-rewarded, single-turn environment is `observe`d with its verified rewards
  (`CriticRefinementTask.observe`: pairs whose rewards differ, both orders); new critic groups are drawn from
  that pool, rolled out and trained by the same update as every group, their reward being agreement with the
  verifier. Start: until the first comparison is observed the environment is not drawn (new groups go to the
  other environments by weight). Resume: the pool (and its RNG) is saved in the checkpoint.
- `reward = "self-critique"` (compact) or `"self-critique-rubric"` on any environment: its groups' rewards are
  `SelfCritiqueReward.group_rewards` with the inference copy of the policy as critic (greedy, every pair in both
  orders, batched in one engine call), minus the named-hack penalties, instead of `task.verify`.

Metrics: `critic_accuracy_sampled` (the critic groups' mean reward in this iteration: sampled accuracy against
the verifier), `critic_pool`, `critic_observed`, and at each evaluation `critic_accuracy`: greedy accuracy on a
fixed held-out set of comparisons, one per order (a position-biased critic scores 0.5). That set is built at the
first evaluation from `HELD_OUT_SAMPLES` samples (T = 1) of the start policy on the verifiable environments'
held-out problems, one pair per problem, and saved in the checkpoint.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from openk2.chat import ChatFormat
from openk2.data.tokenizer import K2Tokenizer
from openk2.infer.engine import Engine
from openk2.infer.sampling import SamplingParams
from openk2.rl.config import EnvSection, RLConfig
from openk2.rl.critic import RUBRIC_FORMAT, CriticFormat, SelfCritic
from openk2.rl.critic_compact import COMPACT_FORMAT, verdict_example
from openk2.rl.critic_loop import LOOP_RUBRICS, CriticRefinementTask, SelfCritiqueReward
from openk2.rl.mixture import MixtureEnv
from openk2.rl.rollout import Group
from openk2.rl.tasks import Problem
from openk2.rl.warmup import Example, sft_example

CRITIC_TASKS: dict[str, CriticFormat] = {"critic": COMPACT_FORMAT, "critic-rubric": RUBRIC_FORMAT}
SELF_CRITIQUE_REWARDS: dict[str, CriticFormat] = {"self-critique": COMPACT_FORMAT,
                                                  "self-critique-rubric": RUBRIC_FORMAT}
CRITIC_MAX_TOKENS = {"critic": 32, "critic-rubric": 64}  # a verdict's default budget per prompt style
HELD_OUT_SAMPLES = 4  # samples per held-out problem that the fixed held-out comparisons are drawn from
POOL_SIZE = 256  # newest comparisons kept: older ones judge an older policy's samples
SEED_OFFSET = 20_000  # the critic's RNG streams (pair sampling, held-out samples) start at run seed + this


@dataclass
class CriticEnv(MixtureEnv):
    """The critic's environment: draws from the pool of observed comparisons (not drawn while it is empty)."""

    task: CriticRefinementTask

    @property
    def ready(self) -> bool:
        return bool(self.task.pool)

    def draw(self, seed: int, iteration: int) -> Problem:
        """A comparison from the pool, chosen by `seed`."""
        return self.task.generate(random.Random(seed).randrange(2**31))


def build_loop_env(spec: EnvSection, cfg: RLConfig, seed: int) -> MixtureEnv | None:
    """The `CriticEnv` of a `task = "critic"` / `"critic-rubric"` entry; None for any other entry."""
    fmt = CRITIC_TASKS.get(spec.task_name)
    if fmt is None:
        return None
    budget = spec.max_tokens or CRITIC_MAX_TOKENS[spec.task_name]
    task = CriticRefinementTask(LOOP_RUBRICS, max_pool=POOL_SIZE, seed=seed + SEED_OFFSET, fmt=fmt,
                                max_tokens=budget)
    return CriticEnv(spec, task, budget, [])


def warmup_example(verdict_share: float) -> Callable[[Problem], Example]:
    """The warm-up's example writer: worked solutions, with `verdict_share` of the problems (chosen by their
    seed) written as worked compact verdicts instead (`critic_compact.verdict_example`)."""
    if verdict_share == 0:
        return sft_example

    def example(problem: Problem) -> Example:
        chosen = random.Random(problem.seed + SEED_OFFSET).random() < verdict_share
        return verdict_example(problem) if chosen else sft_example(problem)

    return example


def generate_texts(model: torch.nn.Module, tokenizer: K2Tokenizer, stop_id: int,
                   conversations: Sequence[list[dict]], *, max_tokens: int, max_batch_size: int,
                   temperature: float = 0.0, seed: int = 0, n: int = 1) -> list[str]:
    """`n` replies per conversation (conversation by conversation) from one engine over `model`."""
    if not conversations:
        return []
    chat = ChatFormat(tokenizer)
    prompts = [chat.prepare(c).token_ids for c in conversations]
    engine = Engine(model, tokenizer, max_batch_size=max_batch_size,
                    max_seq_len=max(len(p) for p in prompts) + max_tokens)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, n=n,
                            stop_token_ids=[stop_id])
    out = []
    for result in engine.generate(prompts, params):
        ids = result.token_ids[:-1] if result.token_ids and result.token_ids[-1] == stop_id else result.token_ids
        out.append(tokenizer.decode(ids))
    return out


class PolicyCritic(SelfCritic):
    """`SelfCritic` over a policy's weights: all the comparisons of one `judge` call decoded greedily together."""

    def __init__(self, policy: torch.nn.Module, tokenizer: K2Tokenizer, stop_id: int, fmt: CriticFormat,
                 max_tokens: int, max_batch_size: int = 64) -> None:
        super().__init__(None, LOOP_RUBRICS, max_tokens, fmt)
        self.policy, self.tokenizer, self.stop_id, self.max_batch_size = policy, tokenizer, stop_id, max_batch_size

    def replies(self, conversations: Sequence[list[dict]]) -> list[str]:
        """Greedy replies, one engine for all of them."""
        return generate_texts(self.policy, self.tokenizer, self.stop_id, conversations, max_tokens=self.max_tokens,
                              max_batch_size=self.max_batch_size)


class CriticLoop:
    """The trainer's hooks for the critic environments and the self-critique rewards (see the module docstring)."""

    def __init__(self, envs: Sequence[MixtureEnv], tokenizer: K2Tokenizer, stop_id: int, cfg: RLConfig) -> None:
        self.critics = [e for e in envs if isinstance(e, CriticEnv)]
        self.sources = {e.name for e in envs if not isinstance(e, CriticEnv) and e.spec.reward == "verifier"}
        self.envs = list(envs)
        if self.critics and not self.sources:
            raise ValueError("a critic environment needs a verifier-rewarded environment to learn from")
        self.tokenizer, self.stop_id, self.cfg = tokenizer, stop_id, cfg
        self.seed = cfg.train.seed + SEED_OFFSET
        self.held_out: dict[str, list[Problem]] = {}  # critic env -> its fixed held-out comparisons

    @classmethod
    def build(cls, envs: Sequence[MixtureEnv], tokenizer: K2Tokenizer, stop_id: int,
              cfg: RLConfig) -> CriticLoop | None:
        """The hooks, or None when the mixture has no critic environment and no self-critique reward."""
        if not any(isinstance(e, CriticEnv) or e.spec.reward in SELF_CRITIQUE_REWARDS for e in envs):
            return None
        return cls(envs, tokenizer, stop_id, cfg)

    # -------------------------------------------------------------------------------- rewards
    def rewards(self, env: MixtureEnv, problem: Problem, texts: Sequence[str],
                policy: torch.nn.Module) -> list[float] | None:
        """The self-critique rewards of one group with `policy` as critic; None for a verifier-rewarded env."""
        fmt = SELF_CRITIQUE_REWARDS.get(env.spec.reward)
        if fmt is None:
            return None
        return SelfCritiqueReward(self.make_critic(fmt, policy)).group_rewards(problem.prompt, texts)

    def make_critic(self, fmt: CriticFormat, policy: torch.nn.Module) -> SelfCritic:
        """The critic that ranks self-critique groups: `policy` itself, greedy (tests replace it with a script)."""
        return PolicyCritic(policy, self.tokenizer, self.stop_id, fmt, self._verdict_tokens(fmt),
                            self.cfg.rollout.max_batch_size)

    def _verdict_tokens(self, fmt: CriticFormat) -> int:
        for env in self.critics:  # a critic environment's budget, when the run has one in this style
            if env.task.fmt is fmt:
                return env.max_tokens
        return CRITIC_MAX_TOKENS["critic" if fmt is COMPACT_FORMAT else "critic-rubric"]

    # -------------------------------------------------------------------------------- the closed loop
    def observe(self, groups: Sequence[Group], raw_PK: torch.Tensor, decode: Callable[[list[int]], str]) -> dict:
        """Feed the verified groups to every critic pool (call before their training step); metrics."""
        record: dict[str, float] = {}
        if not self.critics:
            return record
        added = 0
        by_name = {e.name: e for e in self.envs}
        for g, rewards in zip(groups, raw_PK.tolist(), strict=True):
            env = by_name.get(g.env, self.envs[0])  # "": a group from before the mixture
            if env.name in self.sources and getattr(env, "tools", None) is None:  # single-turn answers only
                texts = [decode(t.token_ids) for t in g.trajectories]
                added += sum(env.task.observe(g.problem, texts, rewards) for env in self.critics)
        critic_rows = [row for g, row in zip(groups, raw_PK.tolist(), strict=True)
                       if g.env in {e.name for e in self.critics}]
        if critic_rows:
            record["critic_accuracy_sampled"] = float(torch.tensor(critic_rows).mean())
        record["critic_observed"] = added
        record["critic_pool"] = sum(len(e.task.pool) for e in self.critics)
        return record

    # -------------------------------------------------------------------------------- evaluation
    def evaluate(self, policy: torch.nn.Module) -> dict:
        """`critic_accuracy`: greedy agreement with the verifier on the fixed held-out comparisons (pooled over
        critic envs; `critic_accuracy/<env>` too when there are several); NaN when the set is empty."""
        if not self.critics:
            return {}
        if not self.held_out:
            self.held_out = {e.name: self._held_out_comparisons(e, policy) for e in self.critics}
        out, scores = {}, []
        for env in self.critics:
            problems = self.held_out[env.name]
            replies = generate_texts(policy, self.tokenizer, self.stop_id,
                                     [[{"role": "user", "content": p.prompt}] for p in problems],
                                     max_tokens=env.max_tokens, max_batch_size=self.cfg.rollout.max_batch_size)
            values = [env.task.verify(p, r) for p, r in zip(problems, replies, strict=True)]
            scores += values
            if len(self.critics) > 1:
                out[f"critic_accuracy/{env.name}"] = sum(values) / len(values) if values else float("nan")
        out["critic_accuracy"] = sum(scores) / len(scores) if scores else float("nan")
        out["critic_eval_comparisons"] = len(scores)
        return out

    def _held_out_comparisons(self, critic: CriticEnv, policy: torch.nn.Module) -> list[Problem]:
        """One pair per held-out problem of the source envs (both orders), from `policy`'s samples at T = 1."""
        builder = CriticRefinementTask(critic.task.rubrics, max_pairs_per_group=1, max_pool=10**9, seed=self.seed,
                                       fmt=critic.task.fmt)
        for env in self.envs:
            if env.name not in self.sources:
                continue
            texts = generate_texts(policy, self.tokenizer, self.stop_id,
                                   [[{"role": "user", "content": p.prompt}] for p in env.eval_problems],
                                   max_tokens=env.max_tokens, max_batch_size=self.cfg.rollout.max_batch_size,
                                   temperature=1.0, seed=self.seed, n=HELD_OUT_SAMPLES)
            for i, problem in enumerate(env.eval_problems):
                group = texts[i * HELD_OUT_SAMPLES: (i + 1) * HELD_OUT_SAMPLES]
                builder.observe(problem, group, [env.task.verify(problem, t) for t in group])
        count = critic.spec.eval_problems or self.cfg.task.eval_problems
        return builder.pool[:count]

    # -------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        """The critic pools and the held-out comparisons, JSON-ready."""
        return {"pools": {e.name: e.task.state_dict() for e in self.critics},
                "held_out": {name: [vars(p) for p in problems] for name, problems in self.held_out.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` saved (a checkpoint from a run without these envs restores nothing)."""
        for env in self.critics:
            if env.name in state.get("pools", {}):
                env.task.load_state_dict(state["pools"][env.name])
        self.held_out = {name: [Problem(**p) for p in problems] for name, problems in state.get("held_out",
                                                                                                   {}).items()}


__all__ = ["CRITIC_TASKS", "SELF_CRITIQUE_REWARDS", "CriticEnv", "CriticLoop", "PolicyCritic", "build_loop_env",
           "generate_texts", "warmup_example"]
