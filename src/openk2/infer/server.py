"""OpenAI-compatible HTTP server over the openk2 `Engine` (`openk2 serve`). See docs/serving.md.

One background thread owns the engine: it takes new requests and aborts from a queue, calls `engine.step()`
while anything is unfinished, and hands tokens and finished samples back to the asyncio handlers through
`loop.call_soon_threadsafe`. Requests from concurrent clients are therefore batched together by the engine's
continuous batching, and the event loop never blocks on a forward pass.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import secrets
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from openk2.chat import TEMPLATES, ChatFormat, ChatFormatError, ReplyDelta, get_reasoning_parser
from openk2.infer.admission import DEFAULT_MAX_INFLIGHT_WORK, DEFAULT_MAX_REQUEST_WORK, WorkBudget
from openk2.infer.protocol import (
    ChatCompletionRequest,
    ModelCard,
    ModelList,
)
from openk2.infer.streaming import NOTES_FIELD, StreamWriter

log = logging.getLogger("openk2.serve")

DEFAULT_MAX_REQUEST_BYTES = 4 << 20
DEFAULT_MAX_TOKENS_LIMIT = None  # no cap of its own: max_tokens is bounded by the context (and the work budget)
DEFAULT_MAX_TOKENS = 4096  # what a request that names no max_tokens gets (less if the context has less room)
MAX_JSON_DEPTH = 64  # nesting of a request body; deeper is refused (400) before anything recurses over it
_HELD_BACK = "\ufffd"  # a split UTF-8 character decodes to this until its last byte arrives


# ------------------------------------------------------------------------------------------------ errors
class APIError(Exception):
    """An error answered as OpenAI's `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


# ------------------------------------------------------------------------------------------- engine loop
@dataclass
class _Sink:
    """Where the engine thread sends one request's events: ("tokens", i, ids, logprobs), ("done", result),
    ("error", exc) or ("rejected", exc)."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    n: int
    stream: bool
    sent: list[int] = field(default_factory=list)
    finished: int = 0
    on_close: Callable[[], None] | None = None  # run once when the engine is done with the request

    def close(self) -> None:
        """The engine holds nothing of this request any more (finished, aborted, failed or rejected)."""
        hook, self.on_close = self.on_close, None
        if hook is not None:
            hook()

    def push(self, event: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the event loop is gone (shutdown)
            pass


class EngineLoop:
    """The thread that owns the engine and steps it while any request is unfinished."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._commands: queue.Queue = queue.Queue()
        self._sinks: dict[str, _Sink] = {}
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="openk2-engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._commands.put(("stop",))
            self._thread.join(timeout=30)
            self._thread = None

    def submit(self, request_id: str, prompt: list[int], params: Any, sink: _Sink) -> None:
        self._commands.put(("add", request_id, prompt, params, sink))

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    # -- thread side
    def _run(self) -> None:
        engine = self.engine
        while True:
            busy = engine.has_unfinished()
            try:
                commands = [self._commands.get(block=not busy)]
            except queue.Empty:
                commands = []
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            for cmd in commands:
                if cmd[0] == "stop":
                    for rid, sink in self._sinks.items():
                        engine.abort(rid)
                        sink.push(("error", RuntimeError("server shutting down")))
                        sink.close()
                    self._sinks.clear()
                    return
                if cmd[0] == "add":
                    _, rid, prompt, params, sink = cmd
                    try:
                        engine.add_request(prompt, params, request_id=rid)
                    except Exception as err:  # noqa: BLE001 - reported to the client as a 400
                        sink.push(("rejected", err))
                        sink.close()
                        continue
                    sink.sent = [0] * sink.n
                    self._sinks[rid] = sink
                elif cmd[0] == "abort":
                    gone = self._sinks.pop(cmd[1], None)
                    if gone is not None:
                        engine.abort(cmd[1])
                        gone.close()
            if not engine.has_unfinished():
                continue
            try:
                finished = engine.step()
            except Exception as err:  # noqa: BLE001 - fail the in-flight requests, keep serving
                log.exception("engine step failed")
                for rid, sink in self._sinks.items():
                    engine.abort(rid)
                    sink.push(("error", err))
                    sink.close()
                self._sinks.clear()
                continue
            self._publish_tokens()
            for result in finished:
                sink = self._sinks.get(result.request_id)
                if sink is None:
                    continue
                sink.push(("done", result))
                sink.finished += 1
                if sink.finished >= sink.n:
                    del self._sinks[result.request_id]
                    sink.close()

    def _publish_tokens(self) -> None:
        """Send streaming requests the tokens their running samples gained in this step."""
        if not any(s.stream for s in self._sinks.values()):
            return
        for request_id, i, tokens, logprobs in self.engine.running_progress():
            sink = self._sinks.get(request_id)
            if sink is None or not sink.stream:
                continue
            n = len(tokens)
            if n > sink.sent[i]:
                sink.push(("tokens", i, list(tokens[sink.sent[i]:n]), list(logprobs[sink.sent[i]:n])))
                sink.sent[i] = n


# ------------------------------------------------------------------------------------------ the service
@dataclass
class _Prepared:
    request: ChatCompletionRequest
    prompt: list[int]
    prefix: str  # text forced at the start of the assistant turn (tool_choice required / named)
    params: Any
    stops: list[str]
    tools: list[dict] | None = None  # the request's tools as sent: the parser resolves id-less calls from them

    @property
    def work(self) -> int:
        """Tokens this request may make the engine generate: n x max_tokens."""
        return self.params.n * self.params.max_tokens


class ChatService:
    """Turns validated requests into engine requests and engine results into OpenAI responses."""

    def __init__(self, engine: Any, tokenizer: Any, model_name: str, max_tokens_limit: int | None,
                 tool_parser: str = "kimi_k2", budget: WorkBudget | None = None, reasoning_parser: str | None = None,
                 chat_template: str | None = None, normalize_tool_call_ids: bool = False) -> None:
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.max_tokens_limit = max_tokens_limit
        self.budget = budget if budget is not None else WorkBudget()
        self.max_seq_len = int(getattr(engine, "max_seq_len", 1 << 30))
        self.loop = EngineLoop(engine)
        self.format = ChatFormat(tokenizer, tool_parser, reasoning_parser, chat_template, normalize_tool_call_ids)
        self.reasoning = reasoning_parser is not None
        self.created = int(time.time())

    # -- request -> engine
    def prepare(self, req: ChatCompletionRequest) -> _Prepared:
        from openk2.infer.sampling import SamplingParams  # torch import, kept out of module import time

        if req.model != self.model_name:
            raise APIError(404, f"The model `{req.model}` does not exist", param="model", code="model_not_found")
        bad = req.unsupported()
        if bad is not None:
            raise APIError(400, bad[1], param=bad[0], code="unsupported_parameter")
        tools = [t.model_dump(exclude_unset=True) for t in req.tools] if req.tools else None  # as sent
        choice = req.tool_choice
        if choice is not None and not isinstance(choice, str):
            choice = choice.model_dump()
        try:
            prepared = self.format.prepare([m.to_template() for m in req.messages], tools, choice)
        except ChatFormatError as err:
            raise APIError(400, str(err), param=err.param) from err
        prompt = prepared.token_ids
        room = self.max_seq_len - len(prompt)
        asked = req.requested_max_tokens()
        if asked is not None and self.max_tokens_limit is not None and asked > self.max_tokens_limit:
            raise APIError(400, f"max_tokens is {asked}, above this server's limit of {self.max_tokens_limit}",
                           param="max_tokens", code="invalid_value")
        default = min(DEFAULT_MAX_TOKENS, self.max_tokens_limit or DEFAULT_MAX_TOKENS, max(room, 1))
        max_tokens = asked if asked is not None else default
        if room < 1 or max_tokens > room:
            raise APIError(400, f"This model's maximum context length is {self.max_seq_len} tokens. However, you "
                           f"requested {len(prompt) + max_tokens} tokens ({len(prompt)} in the messages, "
                           f"{max_tokens} in the completion).", param="messages", code="context_length_exceeded")
        try:
            params = SamplingParams(**req.to_sampling_params(max_tokens, prepared.stop_token_ids))
        except ValueError as err:
            raise APIError(400, str(err)) from err
        params.constraint = self.constraint(req, tools, choice)
        prep = _Prepared(req, prompt, prepared.prefix, params, req.stop_list(), tools)
        if self.budget.too_big(prep.work):
            raise APIError(400, f"n x max_tokens is {params.n} x {params.max_tokens} = {prep.work} tokens, above "
                           f"this server's per-request limit of {self.budget.per_request}; ask for fewer samples "
                           "or tokens", param="max_tokens", code="request_too_large")
        return prep

    def constraint(self, req: ChatCompletionRequest, tools: list[dict] | None, choice: str | dict | None):
        """The grammar a reply must follow (openk2.infer.grammar): forced or strict tool calls, JSON output."""
        from openk2.infer.grammar import reply_constraint

        vocab = getattr(getattr(getattr(self.engine, "model", None), "config", None), "vocab_size", None)
        try:
            return reply_constraint(self.tokenizer, vocab or self.tokenizer.vocab_size, tools, choice,
                                    req.response_format, getattr(self, "strict_tool_calls", False),
                                    getattr(self, "grammar_max_string_length", None), req.parallel_tool_calls)
        except ValueError as err:
            raise APIError(400, str(err), param="response_format") from err

    def submit(self, prep: _Prepared, request_id: str) -> _Sink:
        """Hand the request to the engine, its work reserved until the engine is done with it (429 if full)."""
        work = prep.work
        if not self.budget.reserve(work):
            raise APIError(429, f"the server is busy: {self.budget.in_flight} tokens (n x max_tokens) are in "
                           f"flight, the limit is {self.budget.per_server} and this request needs {work}; retry "
                           "later", type_="rate_limit_error", code="server_busy")
        sink = _Sink(asyncio.get_running_loop(), asyncio.Queue(), prep.params.n, prep.request.stream,
                     on_close=lambda: self.budget.release(work))
        self.loop.submit(request_id, prep.prompt, prep.params, sink)
        return sink

    # -- engine -> response
    def logprob_entries(self, ids: Sequence[int], lps: Sequence[float]) -> list[dict]:
        out = []
        for t, lp in zip(ids, lps, strict=True):
            tok = self.tokenizer.decode([t])
            out.append({"token": tok, "logprob": float(lp), "bytes": list(tok.encode("utf-8")), "top_logprobs": []})
        return out

    def completion(self, prep: _Prepared, request_id: str, results: list[Any]) -> dict:
        choices = []
        completion_tokens = 0
        for r in sorted(results, key=lambda r: r.sample_index):
            completion_tokens += len(r.token_ids)
            reply = self.format.finish(r, prep.prefix, prep.tools)
            message: dict[str, Any] = {"content": reply.content, "refusal": None, "role": "assistant"}
            if self.reasoning:
                message["reasoning_content"] = reply.reasoning_content
            if reply.tool_calls:
                message["tool_calls"] = reply.tool_calls
            choice: dict[str, Any] = {"finish_reason": reply.finish_reason,
                                      "index": r.sample_index, "logprobs": None, "message": message}
            if reply.notes:  # calls the parser dropped (unresolvable ids): said, not silently lost
                choice[NOTES_FIELD] = reply.notes
            if prep.request.logprobs:
                entries = self.logprob_entries(*self.format.completion_tokens(r))
                choice["logprobs"] = {"content": entries, "refusal": None}
            choices.append(choice)
        return {"id": request_id, "choices": choices, "created": int(time.time()), "model": self.model_name,
                "object": "chat.completion", "system_fingerprint": None,
                "usage": self.usage(len(prep.prompt), completion_tokens)}

    @staticmethod
    def usage(prompt_tokens: int, completion_tokens: int) -> dict:
        return {"completion_tokens": completion_tokens, "prompt_tokens": prompt_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    async def collect(self, sink: _Sink) -> list[Any]:
        results = []
        while len(results) < sink.n:
            event = await sink.queue.get()
            kind = event[0]
            if kind == "done":
                results.append(event[1])
            elif kind == "rejected":
                raise APIError(400, str(event[1]))
            elif kind == "error":
                raise APIError(500, f"generation failed: {event[1]}", type_="server_error")
        return results

    async def stream(self, prep: _Prepared, request_id: str, sink: _Sink) -> AsyncIterator[bytes]:
        """The SSE body of a streamed completion (`openk2.infer.streaming` gives its shape)."""
        want_lp = prep.request.logprobs
        held = max((len(s) for s in prep.stops), default=1) - 1
        opts = prep.request.stream_options
        out = StreamWriter(request_id, self.model_name, int(time.time()), bool(opts and opts.include_usage))
        states = [{"ids": [], "emitted": 0, "reply": self.format.reply_stream(prep.tools), "notes": []}
                  for _ in range(sink.n)]
        completion_tokens = 0
        done = 0
        try:
            for i in range(sink.n):
                yield out.role(i)
                if prep.prefix:  # the forced start of the reply (tool_choice) is part of the reply
                    for chunk in out.deltas(i, states[i]["reply"].feed(prep.prefix)):
                        yield chunk
            while done < sink.n:
                event = await sink.queue.get()
                kind = event[0]
                if kind in ("rejected", "error"):
                    err = APIError(400, str(event[1])) if kind == "rejected" else APIError(
                        500, f"generation failed: {event[1]}", type_="server_error")
                    yield f"data: {json.dumps(err.body())}\n\n".encode()
                    return
                if kind == "tokens":
                    _, i, ids, lps = event
                    st = states[i]
                    st["ids"] += ids
                    text = self.tokenizer.decode(st["ids"])
                    safe = len(text.rstrip(_HELD_BACK)) - held  # hold back what a stop string could still cut
                    piece = text[st["emitted"]:safe] if safe > st["emitted"] else ""
                    st["emitted"] = max(st["emitted"], safe)
                    delta = st["reply"].feed(piece) if piece else ReplyDelta()
                    st["notes"] += delta.notes
                    for chunk in out.deltas(i, delta, self.logprob_entries(ids, lps) if want_lp else None):
                        yield chunk
                    continue
                result = event[1]  # "done"
                done += 1
                i = result.sample_index
                st = states[i]
                completion_tokens += len(result.token_ids)
                ids, lps = self.format.completion_tokens(result)
                text = self.format.completion_text(result)
                already = self.tokenizer.decode(st["ids"])[: st["emitted"]]
                piece = text[len(already):] if text.startswith(already) else ""
                first, last = st["reply"].feed(piece), st["reply"].finish()
                delta = ReplyDelta(first.reasoning + last.reasoning, first.content + last.content,
                                   first.tool_calls + last.tool_calls)
                st["notes"] += first.notes + last.notes
                new_lp = self.logprob_entries(ids[len(st["ids"]):], lps[len(st["ids"]):]) if want_lp else None
                for chunk in out.deltas(i, delta, new_lp or None):
                    yield chunk
                yield out.finish(i, result.finish_reason, st["notes"])
            usage = out.usage(self.usage(len(prep.prompt), completion_tokens))
            if usage is not None:
                yield usage
            yield b"data: [DONE]\n\n"
        finally:
            if done < sink.n:
                self.loop.abort(request_id)


# ---------------------------------------------------------------------------------------------- the app
def _load(checkpoint: str | Path, max_batch_size: int, max_seq_len: int, device: str | None, dtype: str | None,
          decode_compile: bool = False):
    import torch

    from openk2.data.tokenizer import K2Tokenizer
    from openk2.infer.engine import Engine
    from openk2.model import K2ForCausalLM

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch_dtype = getattr(torch, dtype) if dtype else (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    model = K2ForCausalLM.from_pretrained(checkpoint, dtype=torch_dtype, device=device).eval()
    tokenizer = K2Tokenizer.load(checkpoint)
    engine = Engine(model, tokenizer=tokenizer, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                    decode_compile=decode_compile)
    return engine, tokenizer


def create_app(
    source: str | Path | tuple[Any, Any],
    model_name: str | None = None,
    api_key: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    max_tokens_limit: int | None = DEFAULT_MAX_TOKENS_LIMIT,
    max_batch_size: int = 8,
    max_seq_len: int = 2048,
    device: str | None = None,
    dtype: str | None = None,
    max_request_work: int | None = DEFAULT_MAX_REQUEST_WORK,
    max_inflight_work: int | None = DEFAULT_MAX_INFLIGHT_WORK,
    reasoning_parser: str | None = None,
    chat_template: str | None = None,
    normalize_tool_call_ids: bool = False,
    strict_tool_calls: bool = False,
    grammar_max_string_length: int | None = None,
    decode_compile: bool = False,
) -> FastAPI:
    """The FastAPI app. `source` is a checkpoint directory (model + tokenizer, loaded here) or an
    `(engine, tokenizer)` pair; the engine must have a tokenizer for stop strings. `model_name` defaults to the
    checkpoint directory's name (or "openk2"). `api_key` (None: no auth) is checked as `Authorization: Bearer`.
    `max_request_work` / `max_inflight_work` bound n x max_tokens per request (400) and in flight (429); None
    lifts a bound (`openk2.infer.admission`). `reasoning_parser` (e.g. "kimi_k2") returns `<think>` text as
    `reasoning_content`; `chat_template` is "kimi_k2" or "kimi_k2_thinking" (the default with a reasoning parser);
    `normalize_tool_call_ids` renders call ids as `functions.NAME:IDX` (K2 Vendor Verifier's advice; see
    docs/serving.md); `decode_compile` compiles the decode step per batch bucket (Engine(decode_compile=True): its
    first step at each batch size bucket waits for the compile)."""
    budget = WorkBudget(max_request_work, max_inflight_work)  # bad limits fail before a model is loaded
    if reasoning_parser is not None:
        get_reasoning_parser(reasoning_parser)  # likewise a bad name
    if chat_template is not None and chat_template not in TEMPLATES:
        raise ValueError(f"unknown chat template {chat_template!r}; expected one of {', '.join(sorted(TEMPLATES))}")
    if isinstance(source, tuple):
        engine, tokenizer = source
        model_name = model_name or "openk2"
    else:
        engine, tokenizer = _load(source, max_batch_size, max_seq_len, device, dtype, decode_compile)
        model_name = model_name or Path(source).resolve().name
    service = ChatService(engine, tokenizer, model_name, max_tokens_limit, budget=budget,
                          reasoning_parser=reasoning_parser, chat_template=chat_template,
                          normalize_tool_call_ids=normalize_tool_call_ids)
    # Constrained decoding (openk2.infer.grammar; docs/serving.md): `strict_tool_calls` holds `auto` calls to the
    # grammar once the model opens a call section; `grammar_max_string_length` caps free strings in arguments.
    service.strict_tool_calls, service.grammar_max_string_length = strict_tool_calls, grammar_max_string_length

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        service.loop.start()
        try:
            yield
        finally:
            service.loop.stop()

    app = FastAPI(title="openk2", lifespan=lifespan)
    app.state.service = service

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, err: APIError) -> JSONResponse:
        return err.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, err: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if err.status_code == 404 else None
        return APIError(err.status_code, str(err.detail), code=code).response()

    @app.exception_handler(Exception)
    async def _crash(_request: Request, err: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return APIError(500, f"internal error: {type(err).__name__}", type_="server_error").response()

    def check_auth(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'.",
                           code="invalid_api_key")

    async def read_body(request: Request) -> bytes:
        length = request.headers.get("content-length")
        too_big = APIError(413, f"request body larger than {max_request_bytes} bytes", code="request_too_large")
        if length is not None and length.isdigit() and int(length) > max_request_bytes:
            raise too_big
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > max_request_bytes:
                raise too_big
        return bytes(body)

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict:
        check_auth(request)
        card = ModelCard(id=model_name, created=service.created, max_model_len=service.max_seq_len)
        return ModelList(data=[card]).model_dump()

    @app.get("/v1/models/{name}")
    async def get_model(name: str, request: Request) -> dict:
        check_auth(request)
        if name != model_name:
            raise APIError(404, f"The model `{name}` does not exist", param="model", code="model_not_found")
        return ModelCard(id=model_name, created=service.created, max_model_len=service.max_seq_len).model_dump()

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        check_auth(request)
        raw = await read_body(request)
        try:
            payload = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise APIError(400, f"We could not parse the JSON body of your request: {err}",
                           code="invalid_json") from err
        except RecursionError as err:  # json's own nesting guard: far deeper than MAX_JSON_DEPTH
            raise APIError(400, f"the JSON body is nested deeper than {MAX_JSON_DEPTH} levels",
                           code="invalid_json") from err
        if not isinstance(payload, dict):
            raise APIError(400, "the request body must be a JSON object", code="invalid_json")
        if _too_deep(payload, MAX_JSON_DEPTH):
            raise APIError(400, f"the JSON body is nested deeper than {MAX_JSON_DEPTH} levels", code="invalid_json")
        try:
            req = ChatCompletionRequest.model_validate(payload)
        except ValidationError as err:
            first = err.errors()[0]
            param = ".".join(str(p) for p in first["loc"]) or None
            raise APIError(400, f"Invalid value for '{param}': {first['msg']}", param=param,
                           code="invalid_value") from err
        prep = service.prepare(req)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        sink = service.submit(prep, request_id)
        if req.stream:
            return StreamingResponse(service.stream(prep, request_id, sink), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        collect = asyncio.ensure_future(service.collect(sink))
        gone = asyncio.ensure_future(_client_gone(request))
        try:
            await asyncio.wait((collect, gone), return_when=asyncio.FIRST_COMPLETED)
            if not collect.done():  # nobody is waiting for the answer: free its engine slots now
                log.info("client of %s disconnected; aborting it", request_id)
                return Response(status_code=499)
            results = collect.result()
        finally:
            for task in (collect, gone):
                task.cancel()
            if sink.finished < sink.n:
                service.loop.abort(request_id)
        return JSONResponse(service.completion(prep, request_id, results))

    return app


async def _client_gone(request: Request) -> None:
    """Return once the client has disconnected. The body is already read, so the ASGI server's next message is
    `http.disconnect` (sent when the connection closes, or once the response is complete)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _too_deep(value: Any, limit: int) -> bool:
    """Whether JSON `value` nests lists/objects more than `limit` levels (iterative: no recursion to exhaust)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > limit:
                return True
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return False
