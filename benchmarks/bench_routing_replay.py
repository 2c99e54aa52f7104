"""Train/rollout mismatch with and without rollout routing replay (R3), on a run where it is non-zero.

The rollout engine samples from a copy of the policy in `--rollout-dtype` (bf16 by default: what a serving
engine runs), recording each token's experts; the training forward runs the fp32 policy over prompt +
response, once routing by itself and once replaying the rollout's experts. Reported per seed and as the
median over seeds: |log pi_train - log pi_rollout| per response token (median, p90, p99, max, mean), the
routing agreement rate (share of the rollout's expert choices the training router makes itself), and the
seconds of one no-grad training forward with and without replay (R3's cost in the forward).

    python benchmarks/bench_routing_replay.py --seeds 0 1 2 --rollout-dtype bf16
    python benchmarks/bench_routing_replay.py --seeds 0 1 2 --rollout-dtype fp32   # kernels/batch shapes only
    python benchmarks/bench_routing_replay.py --checkpoint runs/pipeline-tiny/rl/checkpoints/step-0000040 \
        --task arithmetic   # a trained policy (`make demo`) on its own task's prompts, stopping at end of turn
    python benchmarks/bench_routing_replay.py --checkpoint runs/rl-tools-tiny/checkpoints/step-0000030 \
        --task lookup --max-tokens 48   # a tool task: multi-turn episodes (tool calls executed, R3 rows for the
                                        # tool text too), counted over the policy's sampled tokens only
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DTYPES, machine_summary, median_time  # noqa: E402

from openk2.chat import ChatFormat  # noqa: E402
from openk2.config import ModelConfig  # noqa: E402
from openk2.data.tokenizer import K2Tokenizer  # noqa: E402
from openk2.infer.engine import Engine  # noqa: E402
from openk2.infer.sampling import SamplingParams  # noqa: E402
from openk2.model import K2ForCausalLM  # noqa: E402
from openk2.rl import tasks  # noqa: E402
from openk2.rl.mismatch import mismatch_record  # noqa: E402
from openk2.rl.rollout import Trajectory  # noqa: E402
from openk2.rl.routing_replay import replay_trace  # noqa: E402
from openk2.rl.tasks.tool_task import ToolTask  # noqa: E402
from openk2.rl.tool_episode import Episode  # noqa: E402
from openk2.rl.tool_rollout import run_episodes  # noqa: E402

COLUMNS = ("logp_diff_median", "logp_diff_p90", "logp_diff_p99", "logp_diff_max", "logp_diff_mean", "route_agree")


def _policy(args: argparse.Namespace, seed: int) -> K2ForCausalLM:
    if args.checkpoint:
        return K2ForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    cfg = ModelConfig.preset(args.preset).replace(initializer_range=args.init_range)
    return K2ForCausalLM(cfg).eval()


def _prompts(args: argparse.Namespace, vocab: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """Prompt ids and stop ids: the task's chat prompts with --task (and a checkpoint's tokenizer), else random
    token ids of --prompt-len/2 to --prompt-len tokens and no stop."""
    if args.task:
        chat = ChatFormat(K2Tokenizer.load(args.checkpoint))
        task = tasks.get(args.task)
        problems = [task.generate(seed * 1000 + i, 1 + i % task.num_difficulties) for i in range(args.prompts)]
        ids = [chat.prepare([{"role": "user", "content": p.prompt}]).token_ids for p in problems]
        return ids, [chat.end_of_turn_id]
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(args.prompt_len // 2, args.prompt_len + 1, (args.prompts,), generator=g).tolist()
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths], []


def _episodes(model: K2ForCausalLM, args: argparse.Namespace, seed: int) -> list[Trajectory]:
    """`--samples` tool episodes of each of `--prompts` problems of the ToolTask `--task`, their routing recorded."""
    chat, task = ChatFormat(K2Tokenizer.load(args.checkpoint)), tasks.get(args.task)
    problems = [task.generate(seed * 1000 + i, 1 + i % task.num_difficulties) for i in range(args.prompts)]
    episodes = [Episode(task, p, chat, args.max_tokens, model.config.max_position_embeddings, task.max_turns)
                for p in problems for _ in range(args.samples)]
    run_episodes(model, chat.tokenizer, episodes, [hash((seed, i)) for i in range(len(episodes))], temperature=1.0,
                 max_batch_size=args.batch, record_routing=True)
    turns = [ep.traj.turns for ep in episodes]
    print(f"seed {seed}: {len(episodes)} episodes, {sum(turns) / len(turns):.2f} turns each, "
          f"{sum(ep.traj.tool_calls for ep in episodes)} tool calls, reward {sum(ep.traj.reward for ep in episodes)}")
    return [ep.traj for ep in episodes]


def _rollout(model: K2ForCausalLM, args: argparse.Namespace, seed: int) -> list[Trajectory]:
    if args.task and isinstance(tasks.get(args.task), ToolTask):
        return _episodes(model, args, seed)
    prompts, stop_ids = _prompts(args, model.config.vocab_size, seed)
    engine = Engine(model, max_batch_size=args.batch, max_seq_len=max(map(len, prompts)) + args.max_tokens,
                    record_routing=True)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=seed, n=args.samples,
                            ignore_eos=not stop_ids, stop_token_ids=stop_ids)
    return [Trajectory.from_result(r) for r in engine.generate(prompts, params)]


def _forward_seconds(policy: K2ForCausalLM, trajectories: list[Trajectory], replay: bool, repeats: int) -> float:
    width = max(len(t.prompt_ids) + len(t.token_ids) for t in trajectories)
    ids = torch.zeros(len(trajectories), width, dtype=torch.long)
    for b, t in enumerate(trajectories):
        ids[b, : len(t.prompt_ids) + len(t.token_ids)] = torch.tensor(t.prompt_ids + t.token_ids)

    @torch.no_grad()
    def run():
        policy(ids, routing=replay_trace(trajectories, policy.config) if replay else None)

    return median_time(run, repeats)[0]


def main(argv: list[str] | None = None) -> int:
    """Print the R3 on/off mismatch table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--rollout-dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--init-range", type=float, default=0.02, help="random-init std (ignored with --checkpoint)")
    p.add_argument("--checkpoint", help="an HF-layout policy to measure instead of a random one")
    p.add_argument("--task", help="with --checkpoint: prompts from this RL task in the chat format")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--batch", type=int, default=32, help="engine max_batch_size")
    p.add_argument("--repeats", type=int, default=3, help="timed training forwards per mode")
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args(argv)
    if args.task and not args.checkpoint:
        p.error("--task needs --checkpoint (its tokenizer)")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(machine_summary())
    print(f"rollout {args.rollout_dtype} engine vs fp32 training forward; {args.prompts} prompts x {args.samples} "
          f"samples x {args.max_tokens} tokens; model {args.checkpoint or args.preset}")
    rows: dict[str, list[dict[str, float]]] = {"off": [], "R3": []}
    for seed in args.seeds:
        policy = _policy(args, seed)
        rollout_model = copy.deepcopy(policy).to(DTYPES[args.rollout_dtype])
        trajectories = _rollout(rollout_model, args, seed)
        record = mismatch_record(policy, trajectories, pad_id=0)
        times = {mode: _forward_seconds(policy, trajectories, mode == "R3", args.repeats) for mode in rows}
        for mode, suffix in (("off", ""), ("R3", "_r3")):
            row = {c: record[c + suffix] for c in COLUMNS}
            row["forward_s"] = times[mode]
            rows[mode].append(row)
            print(f"seed {seed} {mode:>3}: " + "  ".join(f"{c}={row[c]:.4g}" for c in (*COLUMNS, "forward_s"))
                  + f"  tokens={int(record['mismatch_tokens' + suffix])}")
    print(f"\nmedian over seeds {args.seeds}:")
    print("| R3 | " + " | ".join((*COLUMNS, "forward_s")) + " |")
    print("|---|" + "---|" * (len(COLUMNS) + 1))
    for mode, values in rows.items():
        print(f"| {mode} | " + " | ".join(f"{statistics.median(v[c] for v in values):.4g}"
                                           for c in (*COLUMNS, "forward_s")) + " |")
    return 0



if __name__ == "__main__":
    sys.exit(main())
