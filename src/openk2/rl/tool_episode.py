"""One multi-turn tool-use episode (K2 report 3.2.1, agentic RL): the policy's turns, the executed calls, and
the token record the loss trains on.

The trajectory is one token sequence, prompt + (policy turn, tool turns, next generation prompt)*, policy
turn. `Trajectory.mask` marks which tokens the policy sampled (1) and which are context the environment
wrote (0: tool results and the template's turn markers around them, with log-prob 0). The loss and pi_old
sum log-probs over the sampled tokens only, so tool text is conditioned on, never trained on.

    prompt  <|im_assistant|>assistant<|im_middle|>           (prompt_ids)
    policy  <|tool_calls_section_begin|>...<|im_end|>         mask 1  (sampled)
    env     <|im_system|>tool<|im_middle|>## Return of ...<|im_end|><|im_assistant|>assistant<|im_middle|>  mask 0
    policy  Answer: 37<|im_end|>                              mask 1  (the final answer: graded)

Hostile by default: each policy turn is parsed by `ChatFormat.finish` (the K2 tool parser); a call that does
not parse, names no declared tool or has arguments the world rejects gets an error tool message (and counts
as malformed) instead of a crash; tool results are truncated to `max_result_chars` and encoded as text
(`encode_pieces`), so a result that spells `<|im_end|>` stays those characters, never a control token. The
episode ends when a turn has no calls (that turn's content is the final answer), when its policy-token budget
or the context runs out (`finish_reason` "length"), or after `max_turns` turns ("turns", reward 0).

R3: a turn's engine result may carry the experts of every position it ran (`Engine(record_routing=True)`); the
trajectory keeps them for prompt, policy and tool positions alike (rl/routing_replay.py, `extend_turn_routing`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from openk2.chat import ChatFormat
from openk2.chat.encoding import encode_pieces
from openk2.chat.pieces import generation_prompt
from openk2.chat.template import render_pieces
from openk2.rl.rollout import Trajectory
from openk2.rl.routing_replay import extend_turn_routing, pad_routing
from openk2.rl.tasks import Problem
from openk2.rl.tasks.tool_task import ToolTask, ToolWorld

_PLACEHOLDER = {"role": "assistant", "content": "."}  # tool turns render the same after any assistant turn


@dataclass
class ToolTrajectory(Trajectory):
    """A trajectory with the episode's record: the final answer text and per-episode counts."""

    final_text: str = ""
    turns: int = 0
    tool_calls: int = 0  # calls the policy made (well-formed or not)
    malformed_calls: int = 0  # calls that got an error message instead of a result
    reward: float = 0.0  # the episode's verified reward, set when the episode ends


@dataclass
class Episode:
    """The state of one episode: the world, the conversation, the trajectory, the remaining budgets."""

    task: ToolTask
    problem: Problem
    fmt: ChatFormat
    max_tokens: int  # policy-sampled tokens over the whole episode
    max_context: int  # prompt + every token of the episode (the engine's max_seq_len)
    max_turns: int
    max_result_chars: int = 400
    world: ToolWorld = field(init=False)
    traj: ToolTrajectory = field(init=False)
    messages: list[dict] = field(init=False)

    def __post_init__(self) -> None:
        self.world = self.task.world(self.problem)
        self.messages = [{"role": "user", "content": self.problem.prompt}]
        self.traj = ToolTrajectory(self.fmt.prepare(self.messages, self.task.tools()).token_ids)

    @property
    def context_ids(self) -> list[int]:
        """What the policy continues from: the prompt and everything so far."""
        return self.traj.prompt_ids + self.traj.token_ids

    def room(self) -> int:
        """New tokens the next policy turn may sample (policy budget and context both bound it)."""
        used = sum(self.traj.mask)
        return max(0, min(self.max_tokens - used, self.max_context - len(self.context_ids)))

    def advance(self, result, version: int = 0) -> bool:
        """Take one finished policy turn (an engine result); run its calls; True when the episode is over."""
        traj = self.traj
        extend_turn_routing(traj, getattr(result, "routing", None), len(self.context_ids))  # before the tokens
        traj.token_ids += list(result.token_ids)
        traj.logprobs += list(result.logprobs)
        traj.mask += [1] * len(result.token_ids)
        traj.versions += [version] * len(result.token_ids)
        traj.num_segments += 1
        traj.turns += 1
        if result.finish_reason != "stop":
            return self.end("length")
        message = self.fmt.finish(result, tools=self.task.tools())
        if not message.tool_calls and not message.notes:
            traj.final_text = message.content or ""
            return self.end("stop")
        if traj.turns >= self.max_turns:
            return self.end("turns")
        results = [self._run(call) for call in message.tool_calls]
        results += [("error", f"error: malformed tool call ({note})") for note in message.notes]
        traj.malformed_calls += len(message.notes)  # calls the parser dropped (no arguments, no function)
        traj.tool_calls += len(results)
        tool_messages = [{"role": "tool", "tool_call_id": call_id, "content": text[: self.max_result_chars]}
                         for call_id, text in results]
        self.messages += [message.to_openai(), *tool_messages]
        context = self._tool_turn_ids(tool_messages)
        if len(self.context_ids) + len(context) >= self.max_context:
            return self.end("length")
        traj.token_ids += context
        traj.logprobs += [0.0] * len(context)
        traj.mask += [0] * len(context)
        traj.versions += [version] * len(context)
        return self.room() == 0 and self.end("length")

    def reward(self) -> float:
        """The verifier's reward on the final answer and the world's state (0 for an episode without one)."""
        if self.traj.finish_reason != "stop":
            return 0.0
        return float(self.task.verify_episode(self.problem, self.traj.final_text, self.world))

    def _run(self, call: dict) -> tuple[str, str]:
        """(call id, result text) of one parsed call; a malformed or rejected call gets an error text."""
        call_id = str(call.get("id") or "error")[:80]
        function = call.get("function") or {}
        try:
            arguments = json.loads(function.get("arguments") or "{}")
        except (json.JSONDecodeError, TypeError):
            arguments = None
        if not isinstance(arguments, dict):
            self.traj.malformed_calls += 1
            return call_id, "error: the arguments are not a JSON object"
        try:
            return call_id, str(self.world.call(str(function.get("name")), arguments))
        except ValueError as err:
            self.traj.malformed_calls += 1
            return call_id, f"error: {err}"

    def _tool_turn_ids(self, tool_messages: list[dict]) -> list[int]:
        """Token ids of the tool turns and the next generation prompt, as the template renders them after an
        assistant turn (text encoded as text)."""
        user = self.messages[:1]
        before = render_pieces([*user, _PLACEHOLDER], self.task.tools(), True)
        after = render_pieces([*user, _PLACEHOLDER, *tool_messages], self.task.tools(), True)
        cut = len(before) - len(generation_prompt())
        assert after[:cut] == before[:cut], "the template renders an assistant turn differently before tool turns"
        return encode_pieces(self.fmt.tokenizer, after[cut:])[0]

    def end(self, reason: str) -> bool:
        """Finish the episode with `reason` (stop, length, turns) and score it; returns True."""
        self.traj.finish_reason = reason
        self.traj.reward = self.reward()
        pad_routing(self.traj)  # tool text after the last turn was never fed to the engine: FREE rows
        return True


__all__ = ["Episode", "ToolTrajectory"]
