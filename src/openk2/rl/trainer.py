"""The colocated RL loop (K2 report 3.2.2 and 4.2): a controller alternates rollout -> rewards -> training ->
weight sync on one machine, each engine holding memory only while it runs.

One iteration:

1. rollout: the inference engine (its own copy of the weights, its KV cache allocated for this phase only)
   resumes the groups paused last iteration and starts `prompts_per_iteration` new ones, K samples each, at the
   decayed temperature; trajectories past `segment_tokens` new tokens are paused (partial rollout);
2. rewards: the task verifies every response of each completed group; truncated responses lose
   `budget_penalty` (budget control);
3. training: `updates_per_iteration` steps of the K1.5 loss (or GRPO) with MuonClip on the completed groups,
   pi_old being each token's sampling log-prob, plus the optional PTX loss on warm-up data;
4. weight sync: the checkpoint engine's bucketed copy moves the new weights into the inference copy.

Engine switching on a GPU also offloads the training engine's parameters and optimizer state to host memory
during step 1 (an H2D copy brings them back; rl/engine_switch.py) and frees the KV cache before step 3; on CPU
both engines share host memory, so only the KV cache is released (see docs/rl.md). With `rollout.placement =
"ray"` the rollout runs on Ray actors and step 4 broadcasts to them (rl/placement.py, rl/ray_placement.py).

Checkpoints (`out_dir/checkpoints/step-N`) hold the policy in HF layout (so `openk2 serve` and `local:` load
them), its tokenizer, the optimizer, the paused groups and the RNG states; `--resume` continues from the newest.
"""

from __future__ import annotations

import copy
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from openk2.chat import ChatFormat
from openk2.data.tokenizer import K2Tokenizer
from openk2.infer.engine import Engine
from openk2.infer.sampling import SamplingParams
from openk2.model import ForwardStats, K2ForCausalLM
from openk2.model.routing import RoutingTrace
from openk2.optim.muonclip import MuonClip
from openk2.rl.config import OptimSection, RLConfig
from openk2.rl.critic_env import CriticLoop, build_loop_env, warmup_example
from openk2.rl.loss import budget_penalty, decayed_temperature, get_loss, ptx_loss
from openk2.rl.mismatch import mismatch_record
from openk2.rl.mixture import MixtureEnv, build_mixture, choose_env, held_out_problems
from openk2.rl.placement import build_placement
from openk2.rl.ptx import PTXStream
from openk2.rl.rollout import Group, PartialRollout, new_group
from openk2.rl.routing_replay import replay_trace
from openk2.rl.tasks.tool_task import ToolTask
from openk2.rl.tool_probe import exclude_probes
from openk2.rl.tool_rollout import attach_tool_rollouts, tool_metrics
from openk2.rl.tool_warmup import run_tool_warmup
from openk2.rl.warmup import encode_prompt, run_warmup
from openk2.rng import RNG_FILE, load_rng_state, save_rng_state, seed_everything
from openk2.train.checkpoint import CheckpointManager
from openk2.train.metrics import MetricsLogger, read_metrics

OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "rl_state.json"
CURVES_FILE = "rl_curves.png"


@dataclass
class RLSummary:
    out_dir: Path
    iteration: int
    checkpoint: Path | None
    first_eval: dict | None
    last_eval: dict | None
    plot: Path | None


class RLTrainer:
    """Owns the policy, the inference copy, the optimizer and the rollout state of one RL run."""

    def __init__(self, cfg: RLConfig, out_dir: str | Path | None = None, resume: bool = False) -> None:
        self.cfg = cfg
        self.out_dir = Path(out_dir or cfg.out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        seed = cfg.train.seed
        seed_everything(seed)
        self.envs = build_mixture(cfg, seed, build_loop_env)  # build_loop_env: the critic's own environment
        exclude_probes(self.envs, cfg.warmup.probe_problems, seed)  # the tool warm-up's probe shops: never trained on
        self.env_by_name = {e.name: e for e in self.envs}
        self.task = self.envs[0].task  # the first environment's task (the only one without [[envs]])
        self.eval_problems = [p for e in self.envs for p in e.eval_problems]
        self.ckpts = CheckpointManager(self.out_dir / "checkpoints", keep_last=cfg.train.keep_checkpoints)
        resume_from = self.ckpts.latest() if resume else None
        if resume and resume_from is None:
            print(f"note: no complete checkpoint in {self.ckpts.root}; starting from scratch", file=sys.stderr)
        if resume_from is not None or cfg.checkpoint is not None:
            source = resume_from or Path(cfg.checkpoint)
            self.policy = K2ForCausalLM.from_pretrained(source, dtype=torch.float32)
            self.tokenizer = K2Tokenizer.load(source)
        elif any(isinstance(e.task, ToolTask) for e in self.envs):  # tool transcripts too (rl/tool_warmup.py)
            self.policy, self.tokenizer = run_tool_warmup(cfg, self.envs, self.out_dir)
        else:
            warm = self._warmup_env()
            self.policy, self.tokenizer = run_warmup(cfg, warm.task, self.out_dir, warm.exclude,
                                                     warm.spec.difficulties,
                                                     example=warmup_example(cfg.warmup.verdict_share))
        self.inference = copy.deepcopy(self.policy).eval()  # the rollout engine's weights (decoupled copy)
        if cfg.rollout.inference_dtype == "bf16":  # as a serving engine runs it; the weight sync casts on copy
            self.inference.to(torch.bfloat16)
        self.optimizer = build_rl_optimizer(self.policy, cfg.optim)
        self.im_end = ChatFormat(self.tokenizer).end_of_turn_id  # the rollouts' stop token
        self.max_tokens = max(e.max_tokens for e in self.envs)  # the longest budget; each group has its own
        self.rollout = PartialRollout(max_tokens=self.max_tokens, segment_tokens=cfg.rollout.segment_tokens or None,
                                      max_batch_size=cfg.rollout.max_batch_size, stop_token_ids=[self.im_end],
                                      seed=seed, record_routing=cfg.rollout.routing_replay
                                      or cfg.rollout.mismatch_every > 0)
        # multi-turn tool environments play their groups as episodes (rl/tool_rollout.py), on the placement's engines
        tools = attach_tool_rollouts(self.envs, self.tokenizer, max_context=self.policy.config.max_position_embeddings,
                                     max_batch_size=cfg.rollout.max_batch_size, seed=seed,
                                     record_routing=self.rollout.record_routing)  # R3 and the monitor cover them
        # where rollouts run and how the weights reach them (rollout.placement: colocated, or Ray workers)
        self.placement = build_placement(cfg.rollout, self.policy, self.inference, self.tokenizer, self.rollout,
                                         bucket_bytes=cfg.train.sync_bucket_mb << 20, threads=cfg.train.threads,
                                         optimizer=self.optimizer, tools=tools)
        self.loss_fn = get_loss(cfg.loss.name)
        self.ptx = PTXStream(self.tokenizer, cfg.loss, seed + 3) if cfg.loss.ptx_weight > 0 else None
        self.critic = CriticLoop.build(self.envs, self.tokenizer, self.im_end, cfg)  # None without critic envs
        self.iteration = 0
        self.next_group = 0
        if resume_from is not None:
            self._load_state(resume_from)
        (self.out_dir / "rl_config.json").write_text(json.dumps(cfg.to_dict(), indent=2, default=str))

    # ------------------------------------------------------------------------------------------ the loop
    def run(self, max_iterations: int | None = None) -> RLSummary:
        """Iterate until `train.iterations` (or `max_iterations` more), evaluating and checkpointing on the way."""
        tc = self.cfg.train
        stop_at = tc.iterations if max_iterations is None else min(tc.iterations, self.iteration + max_iterations)
        metrics = MetricsLogger(self.out_dir, resume_step=self.iteration if self.iteration else None)
        last_ckpt = None
        try:
            if self.iteration == 0:
                metrics.log({"step": 0, **self.evaluate()})
            bar = tqdm(total=stop_at, initial=self.iteration, desc="rl", unit="iter", dynamic_ncols=True,
                       disable=None)
            while self.iteration < stop_at:
                record = self.iterate()
                if self.iteration % tc.eval_every == 0 or self.iteration == stop_at:
                    record.update(self.evaluate())
                metrics.log(record)
                bar.update(1)
                bar.set_postfix(reward=f"{record['reward_mean']:.2f}")
                if self.iteration % tc.checkpoint_every == 0 or self.iteration == stop_at:
                    last_ckpt = self.save_checkpoint()
            bar.close()
        finally:
            metrics.close()
        evals = [r for r in read_metrics(self.out_dir) if "eval_reward" in r]
        plot = plot_rl_curves(self.out_dir)
        return RLSummary(self.out_dir, self.iteration, last_ckpt, evals[0] if evals else None,
                         evals[-1] if evals else None, plot)

    def close(self) -> None:
        """Release the rollout placement (Ray workers and the weight-sync group; nothing when colocated)."""
        self.placement.close()

    def iterate(self) -> dict:
        """One rollout -> rewards -> training -> weight-sync iteration; returns its metrics record."""
        rc = self.cfg.rollout
        temperature = decayed_temperature(self.iteration, rc.temperature, rc.final_temperature,
                                          rc.temperature_decay_iterations, rc.temperature_schedule)
        drawn = [self._new_group() for _ in range(rc.prompts_per_iteration)]
        fresh = [g for g in drawn if g is not None]  # None: drawn for an eval_only env, not started
        tool_groups = [g for g in fresh if self._env(g).tools is not None]  # finish within this iteration
        fresh = [g for g in fresh if self._env(g).tools is None]
        start = time.perf_counter()
        done, stats = self.placement.rollout(fresh, iteration=self.iteration, version=self.iteration,
                                             temperature=temperature, tool_groups=tool_groups)  # tools in place
        done = done + tool_groups
        rollout_s = time.perf_counter() - start
        record = {"temperature": temperature, "new_tokens": stats.new_tokens, "paused": stats.paused,
                  "resumed": stats.resumed, "groups_trained": len(done), "rollout_s": rollout_s}
        if not all(e.trains for e in self.envs):
            record["groups_not_started"] = len(drawn) - len(fresh) - len(tool_groups)
        self.iteration += 1
        if done:
            start = time.perf_counter()
            record.update(self._train(done))
            record["train_s"] = time.perf_counter() - start
            sync = self.placement.sync(self.policy.state_dict())
            record.update(sync_s=sync.seconds, sync_gb_s=sync.gb_per_s)
        else:
            record.update(reward_mean=float("nan"))
        return {"step": self.iteration, **record}

    # ------------------------------------------------------------------------------------------ training
    def _rewards(self, groups: list[Group]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Verified rewards [P, K], rewards after the budget penalty [P, K], response lengths [P, K]."""
        raw, lengths, budgets = [], [], []
        for g in groups:
            task = self._env(g).task
            if self._env(g).tools is not None:  # a tool episode is scored when it ends (rl/tool_episode.py)
                raw.append([t.reward for t in g.trajectories])
            else:
                texts = [self._response_text(t.token_ids) for t in g.trajectories]
                judged = self.critic.rewards(self._env(g), g.problem, texts, self.inference) if self.critic else None
                raw.append(judged if judged is not None else [task.verify(g.problem, text) for text in texts])
            lengths.append([t.num_sampled for t in g.trajectories])  # policy-sampled tokens (no tool text)
            budgets.append([self.rollout.budget(g)] * len(g.trajectories))
        raw_t, len_t = torch.tensor(raw), torch.tensor(lengths)
        penalised = budget_penalty(raw_t, len_t, torch.tensor(budgets), self.cfg.loss.budget_penalty)
        return raw_t, penalised, len_t

    def _env(self, group: Group) -> MixtureEnv:
        return self.env_by_name.get(group.env) or self.envs[0]  # "" (a checkpoint from before the mixture)

    def _response_text(self, token_ids: list[int]) -> str:
        ids = token_ids[:-1] if token_ids and token_ids[-1] == self.im_end else token_ids
        return self.tokenizer.decode(ids)

    def _train(self, groups: list[Group]) -> dict:
        raw, rewards, lengths = self._rewards(groups)
        budgets = torch.tensor([[self.rollout.budget(g)] for g in groups])
        record = {"reward_mean": float(raw.mean()), "reward_penalised_mean": float(rewards.mean()),
                  "response_len": float(lengths.float().mean()),
                  "truncated": float((lengths >= budgets).float().mean())}
        if len(self.envs) > 1:
            record.update(per_env_metrics(raw, lengths, [g.env for g in groups]))
        for env in self.envs:
            if env.tools is not None:  # tool calls per episode, malformed-call rate, turns
                record.update(tool_metrics(groups, env.name))
        if self.critic is not None:  # the closed loop: the critic's pools learn these verified groups first
            record.update(self.critic.observe(groups, raw, self._response_text))
        informative = informative_groups(rewards)
        record["groups_informative"] = int(informative.sum())
        every = self.cfg.rollout.mismatch_every
        if every and (self.iteration - 1) % every == 0:  # before any update: the weights that sampled them
            record.update(mismatch_record(self.policy, [t for g in groups for t in g.trajectories],
                                          self.tokenizer.pad_id, version=self.iteration - 1))
        if not informative.any():
            # No group has a reward signal: the gradient would be only the regulariser on log pi - log pi_old
            # (engine-vs-training rounding on fresh samples). Muon and AdamW normalise the step, so it would be a
            # full-size step in a direction that is pure noise (docs/rl.md, "The pipeline's RL stage"): take none.
            return {**record, "loss": float("nan"), "grad_norm": float("nan"), "entropy": float("nan"),
                    "updates": 0}
        if self.cfg.loss.drop_uniform_groups:  # also leave the zero-advantage groups out of a mixed batch
            groups = [g for g, keep in zip(groups, informative.tolist(), strict=True) if keep]
            rewards, lengths = rewards[informative], lengths[informative]
        trajectories = [t for g in groups for t in g.trajectories]
        p, k = rewards.shape
        logp_old = torch.tensor([t.logprob_old for t in trajectories]).view(p, k)
        per_token = self.cfg.loss.logp_reduction == "mean"
        if per_token:  # both log-probs of the log-ratio become per-token means
            logp_old = logp_old / lengths.clamp(min=1)
        self.policy.train()
        # R3: every update's forward runs the experts the rollout ran (gate weights from the current router)
        routing = replay_trace(trajectories, self.policy.config) if self.cfg.rollout.routing_replay else None
        losses, entropy, grad_norm, clip, log_ratio = [], float("nan"), float("nan"), None, float("nan")
        for update in range(self.cfg.train.updates_per_iteration):
            stats = ForwardStats(self.policy.config, track_max_logits=True)  # this update's; MuonClip reads it
            logp_N, token_entropy = response_logprobs(self.policy, trajectories, self.tokenizer.pad_id, stats,
                                                      routing=routing)
            logp_PK = logp_N.view(p, k) / lengths.clamp(min=1) if per_token else logp_N.view(p, k)
            if update == 0:
                entropy = token_entropy
                log_ratio = float((logp_PK.detach() - logp_old).abs().mean())
            loss = self._policy_loss(logp_PK, logp_old, rewards)
            if self.ptx is not None:
                loss = loss + ptx_loss(self.policy, self.ptx.batch(), self.cfg.loss.ptx_weight, stats=stats)
            loss.backward()
            grad_norm = self._clip_gradients()
            clip = self.optimizer.step(stats.max_logits())
            self.optimizer.zero_grad()
            losses.append(loss.item())
        return {**record, "entropy": entropy, "loss": float(np.mean(losses)), "grad_norm": grad_norm,
                "log_ratio_abs": log_ratio, "updates": len(losses),
                "max_logit": clip.max_logit if clip is not None else float("nan"),
                "policy_lag": float(np.mean([self.iteration - 1 - min(t.versions) for t in trajectories]))}

    def _policy_loss(self, logp: torch.Tensor, logp_old: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
        if self.cfg.loss.name == "k15":
            return self.loss_fn(logp, logp_old, rewards, tau=self.cfg.loss.tau)
        return self.loss_fn(logp, logp_old, rewards, clip_eps=self.cfg.loss.clip_eps)

    def _clip_gradients(self) -> float:
        params = [q for q in self.policy.parameters() if q.grad is not None]
        max_norm = self.cfg.optim.grad_clip if self.cfg.optim.grad_clip > 0 else float("inf")
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))

    def _new_group(self) -> Group | None:
        gid = self.next_group
        self.next_group += 1
        seed = self.cfg.train.seed
        env = choose_env(self.envs, seed=hash((seed, gid, 1)))  # ints only: hash() of a str varies per process
        if not env.trains:  # an eval_only env's draw: the group id is used up, so later draws are unchanged
            return None
        problem = env.draw(hash((seed, gid)), self.iteration)
        prompt = env.tools.prompt_ids(problem) if env.tools is not None else encode_prompt(self.tokenizer, problem)
        return new_group(gid, problem, prompt, self.cfg.rollout.samples_per_prompt,
                         self.iteration, env=env.name, max_tokens=env.max_tokens)

    def _warmup_env(self) -> MixtureEnv:
        """The environment the supervised warm-up writes worked solutions for (arithmetic only)."""
        for env in self.envs:
            if env.spec.task_name == "arithmetic":
                return env
        raise ValueError("the supervised warm-up writes arithmetic solutions; a mixture without arithmetic needs "
                         "[model] checkpoint = <an SFT policy>")

    # ------------------------------------------------------------------------------------------ evaluation
    def evaluate(self) -> dict:
        """Mean verified reward on the held-out problems: greedy, and `task.eval_samples` samples each at T = 1
        (seeds seed, seed+1, ...: the same draws at every evaluation, so evaluations are paired). With several
        environments, `eval_reward/<env>` and `eval_reward_sampled/<env>` too; the plain keys pool them all."""
        prompts = {e.name: [encode_prompt(self.tokenizer, p) for p in e.eval_problems] for e in self.envs}
        longest = max(len(ids) + e.max_tokens for e in self.envs for ids in prompts[e.name])
        engine = Engine(self.inference, self.tokenizer, max_batch_size=self.cfg.rollout.max_batch_size,
                        max_seq_len=longest)
        passes = [("eval_reward", 0.0, 0)] + [("eval_reward_sampled", 1.0, i)
                                               for i in range(self.cfg.task.eval_samples)]
        scores: dict[str, list[float]] = {}
        greedy_lengths: list[int] = []
        for env in self.envs:
            if not env.eval_problems:  # the critic's environment: its held-out accuracy is critic_accuracy
                continue
            for name, temperature, offset in passes:
                if env.tools is not None:  # multi-turn episodes, scored by the task's episode verifier
                    values, lengths = env.tools.evaluate(self.inference, env.eval_problems, temperature=temperature,
                                                         seed=self.cfg.train.seed + offset)
                else:
                    params = SamplingParams(max_tokens=env.max_tokens, temperature=temperature,
                                            seed=self.cfg.train.seed + offset, stop_token_ids=[self.im_end])
                    results = engine.generate(prompts[env.name], params)
                    values = [env.task.verify(p, self._response_text(r.token_ids))
                              for p, r in zip(env.eval_problems, results, strict=True)]
                    lengths = [len(r.token_ids) for r in results]
                scores.setdefault(name, []).extend(values)
                if len(self.envs) > 1:
                    scores.setdefault(f"{name}/{env.name}", []).extend(values)
                if temperature == 0.0:
                    greedy_lengths += lengths
        out = {"eval_response_len": float(np.mean(greedy_lengths))}
        if self.critic is not None:
            out.update(self.critic.evaluate(self.inference))
        out.update({name: float(np.mean(values)) for name, values in scores.items()})
        return out

    # ------------------------------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path:
        """Policy (HF layout) + tokenizer + optimizer + paused groups + counters + RNG, written atomically."""

        def write(path: Path) -> None:
            self.policy.save_pretrained(path)
            self.tokenizer.save(path)
            torch.save(self.optimizer.state_dict(), path / OPTIMIZER_FILE)
            save_rng_state(path / RNG_FILE)
            state = {"iteration": self.iteration, "next_group": self.next_group,
                     "rollout": self.rollout.state_dict()}
            if self.critic is not None:  # the pools of observed comparisons cannot be rebuilt
                state["critic"] = self.critic.state_dict()
            (path / STATE_FILE).write_text(json.dumps(state))

        return self.ckpts.save(self.iteration, write)

    def _load_state(self, path: Path) -> None:
        self.optimizer.load_state_dict(torch.load(path / OPTIMIZER_FILE, weights_only=False))
        state = json.loads((path / STATE_FILE).read_text())
        self.iteration, self.next_group = state["iteration"], state["next_group"]
        self.rollout.load_state_dict(state["rollout"])
        if self.critic is not None:
            self.critic.load_state_dict(state.get("critic", {}))
        load_rng_state(path / RNG_FILE)
        print(f"resumed from {path} at iteration {self.iteration}", file=sys.stderr)


# ---------------------------------------------------------------------------------------------- helpers
def informative_groups(rewards_PK: torch.Tensor) -> torch.Tensor:
    """[P] bool: the groups whose K rewards are not all equal (the others have zero advantage for every sample)."""
    return rewards_PK.amax(dim=1) > rewards_PK.amin(dim=1)


def per_env_metrics(raw_PK: torch.Tensor, lengths_PK: torch.Tensor, envs: list[str]) -> dict[str, float]:
    """`reward_mean/<env>`, `response_len/<env>` and `groups_trained/<env>` of one iteration's trained groups."""
    out: dict[str, float] = {}
    for name in sorted(set(envs)):
        rows = torch.tensor([e == name for e in envs])
        out[f"reward_mean/{name}"] = float(raw_PK[rows].mean())
        out[f"response_len/{name}"] = float(lengths_PK[rows].float().mean())
        out[f"groups_trained/{name}"] = int(rows.sum())
    return out


def build_rl_optimizer(policy: torch.nn.Module, oc: OptimSection) -> MuonClip:
    """MuonClip with Muon or AdamW, or with SGD + momentum in its AdamW slot (QK-Clip and the probe still run).

    SGD keeps the relative sizes of the gradient's components, where Muon (spectral) and AdamW (per-coordinate)
    normalise them. It tests whether that normalisation of a noisy policy gradient hurts; on the tiny arithmetic
    run it did no better than Muon (docs/rl.md, the sweep).
    """
    optimizer = MuonClip(policy, lr=oc.lr, weight_decay=oc.weight_decay, tau=oc.qk_clip_tau,
                         use_muon=oc.optimizer == "muon")
    if oc.optimizer == "sgd":
        optimizer.adamw = torch.optim.SGD([q for q in policy.parameters() if q.requires_grad], lr=oc.lr,
                                          momentum=oc.momentum, weight_decay=oc.weight_decay)
    return optimizer


def response_logprobs(model: torch.nn.Module, trajectories: list, pad_id: int,
                      stats: ForwardStats | None = None,
                      routing: RoutingTrace | None = None) -> tuple[torch.Tensor, float]:
    """log pi(y|x) [N] of each trajectory's response under `model` (with grad), from one plain forward of
    prompt + response (recorded into `stats` when given; replaying the rollout's experts when `routing` is
    `routing_replay.replay_trace(trajectories, ...)`), and the mean per-token entropy of the policy over the
    response positions."""
    ids_NT, targets_NT, mask_NT = _pack_sequences(trajectories, pad_id)
    logp_NTV = model(ids_NT, stats=stats, routing=routing).logits[:, :-1].float().log_softmax(-1)
    token_logp = logp_NTV.gather(-1, targets_NT[..., None]).squeeze(-1) * mask_NT
    with torch.no_grad():
        entropy_NT = -(logp_NTV.exp() * logp_NTV).sum(-1)
        entropy = float((entropy_NT * mask_NT).sum() / mask_NT.sum())
    return token_logp.sum(-1), entropy


def _pack_sequences(trajectories, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [N, T] (prompt + response, right-padded), targets [N, T-1] = ids shifted left, and mask [N, T-1]
    = 1 where the target is a response token (the positions whose log-probs enter log pi(y|x))."""
    width = max(len(t.prompt_ids) + len(t.token_ids) for t in trajectories)
    ids = torch.full((len(trajectories), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(trajectories), width - 1)
    for b, t in enumerate(trajectories):
        seq = t.prompt_ids + t.token_ids
        ids[b, : len(seq)] = torch.tensor(seq)
        # a multi-turn episode's tool text is context (mask 0): only the tokens the policy sampled count
        mask[b, len(t.prompt_ids) - 1: len(seq) - 1] = torch.tensor(t.mask, dtype=mask.dtype) if t.mask else 1.0
    return ids, ids[:, 1:], mask


def plot_rl_curves(run_dir: str | Path) -> Path | None:
    """rl_curves.png: reward (training samples, held-out greedy and sampled), response length and entropy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)

    def series(key):
        rows = [(r["step"], r[key]) for r in records if key in r and r[key] == r[key]]
        return [s for s, _ in rows], [v for _, v in rows]

    if not series("reward_mean")[0] and not series("eval_reward")[0]:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for key, label in (("reward_mean", "rollouts (train)"), ("eval_reward", "held-out, greedy"),
                       ("eval_reward_sampled", "held-out, T=1")):
        x, y = series(key)
        axes[0].plot(x, y, "o-" if key.startswith("eval") else "-", label=label, lw=1, ms=3)
    axes[0].set(xlabel="iteration", ylabel="mean verified reward", title="Reward", ylim=(0, 1))
    axes[0].legend()
    for ax, key, title in ((axes[1], "response_len", "Response length (tokens)"), (axes[2], "entropy",
                                                                                   "Policy entropy (nats/token)")):
        x, y = series(key)
        ax.plot(x, y, lw=1)
        ax.set(xlabel="iteration", title=title)
    fig.tight_layout()
    path = Path(run_dir) / CURVES_FILE
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = ["RLSummary", "RLTrainer", "build_rl_optimizer", "held_out_problems", "informative_groups",
           "per_env_metrics", "plot_rl_curves",
           "response_logprobs"]
