"""OpenAI-compatible wire types for `/v1/chat/completions` and `/v1/models` (pydantic, no torch).

Fields follow the order of OpenAI's API reference. Request fields that OpenAI defines but openk2 does not
implement are accepted only at their neutral value (see `ChatCompletionRequest.unsupported`); unknown fields are
ignored, as OpenAI-compatible servers commonly do. `to_sampling_params()` is the one place where a request turns
into engine `SamplingParams` keyword arguments.
"""

from __future__ import annotations

import re
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

FUNCTION_NAME_RE = re.compile(r"[\w.\-]+")
ROLES = ("system", "developer", "user", "assistant", "tool")


# ---------------------------------------------------------------------------------------------- request
class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not FUNCTION_NAME_RE.fullmatch(v) or len(v) > 64:
            raise ValueError(f"function name {v!r} must match [a-zA-Z0-9_.-]+ and have at most 64 characters")
        return v

    @field_validator("parameters")
    @classmethod
    def _parameters(cls, v: dict | None) -> dict | None:
        if v is not None and "type" in v and v["type"] != "object":
            raise ValueError("function parameters must be a JSON Schema object (type 'object')")
        return v


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedToolChoiceFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedToolChoiceFunction


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatMessage(BaseModel):
    """One input message; kept loose (extra keys pass through to the chat template)."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @field_validator("role")
    @classmethod
    def _role(cls, v: str) -> str:
        if v not in ROLES:
            raise ValueError(f"unknown role {v!r}; expected one of {', '.join(ROLES)}")
        return v

    def to_template(self) -> dict:
        """The dict `openk2.chat.template.render` takes; JSON nulls count as absent (roles pass as they are:
        the K2 template gives `developer` its own `<|im_system|>developer` turn)."""
        return self.model_dump(exclude_none=True)


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    messages: list[ChatMessage] = Field(min_length=1)
    model: str
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool = False
    max_completion_tokens: int | None = Field(default=None, ge=1)
    max_tokens: int | None = Field(default=None, ge=1)
    n: int = Field(default=1, ge=1, le=128)
    parallel_tool_calls: bool | None = None
    presence_penalty: float | None = None
    response_format: dict[str, Any] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    tools: list[Tool] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    user: str | None = None
    # openk2 extension (vLLM spelling): top-k filtering, 0 = off.
    top_k: int = 0

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return v

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) for the first OpenAI option set to something openk2 cannot honour, else None."""
        if self.frequency_penalty:
            return "frequency_penalty", "frequency_penalty is not supported"
        if self.presence_penalty:
            return "presence_penalty", "presence_penalty is not supported"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        if self.top_logprobs:
            return "top_logprobs", "top_logprobs > 0 is not supported (only the sampled token's logprob)"
        if self.response_format and self.response_format.get("type", "text") not in (
                "text", "json_object", "json_schema"):
            return "response_format", "response_format type must be 'text', 'json_object' or 'json_schema'"
        return None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def to_sampling_params(self, max_tokens: int, stop_token_ids: tuple[int, ...] = ()) -> dict:
        """Keyword arguments for `openk2.infer.sampling.SamplingParams` (max_tokens already resolved)."""
        return {
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "n": self.n,
            "stop_token_ids": tuple(stop_token_ids),
            "stop": tuple(self.stop_list()),
        }


# --------------------------------------------------------------------------------------------- response
class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None
    refusal: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    content: str | None = None
    refusal: str | None = None
    role: Literal["assistant"] = "assistant"
    tool_calls: list[ToolCallOut] | None = None
    # openk2 extension (vLLM/DeepSeek spelling), only with --reasoning-parser: the model's <think> text.
    reasoning_content: str | None = None


class Choice(BaseModel):
    finish_reason: Literal["stop", "length", "tool_calls", "content_filter"]
    index: int
    logprobs: ChoiceLogprobs | None = None
    message: AssistantMessage


class Usage(BaseModel):
    completion_tokens: int
    prompt_tokens: int
    total_tokens: int


class ChatCompletion(BaseModel):
    id: str
    choices: list[Choice]
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    object: Literal["chat.completion"] = "chat.completion"
    system_fingerprint: str | None = None
    usage: Usage | None = None


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChoiceDelta(BaseModel):
    content: str | None = None
    role: Literal["assistant"] | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning_content: str | None = None  # openk2 extension, as in AssistantMessage


class ChunkChoice(BaseModel):
    delta: ChoiceDelta
    finish_reason: Literal["stop", "length", "tool_calls", "content_filter"] | None = None
    index: int
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    choices: list[ChunkChoice]
    created: int
    model: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    system_fingerprint: str | None = None
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    object: Literal["model"] = "model"
    owned_by: str = "openk2"
    # openk2 extension (vLLM spelling): the context length, prompt plus completion tokens.
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
