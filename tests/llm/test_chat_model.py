"""ChatModel backends: the OpenAI backend against a running `openk2 serve` app, the local engine on the same
checkpoint; greedy decoding must give the same turn through both."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("openai")
pytest.importorskip("fastapi")

from openk2.llm import ChatModel, ChatResponse, load_chat_model  # noqa: E402
from openk2.llm.local import LocalChatModel  # noqa: E402
from tests.infer import test_server as _srv  # noqa: E402
from tests.infer.test_server import API_KEY, HELLO, MODEL, TOOLS  # noqa: E402

# Session fixtures shared with the server tests (one checkpoint, one running server).
checkpoint, real_server, scripted = _srv.checkpoint, _srv.real_server, _srv.scripted

CONVS = [HELLO, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2 ="}]]


@pytest.fixture(scope="module")
def remote(real_server):
    model = load_chat_model(f"openai:{real_server.base}/v1#{MODEL}", timeout=60, max_retries=1, max_concurrency=4)
    yield model
    model.close()


@pytest.fixture(scope="module")
def local(checkpoint):
    return load_chat_model(f"local:{checkpoint}", max_seq_len=256, device="cpu", dtype="float32")


def test_registry(real_server, checkpoint):
    with pytest.raises(ValueError, match="neither"):
        load_chat_model("hf:some/model")
    with pytest.raises(ValueError):
        load_chat_model("nonsense")
    with pytest.raises(ValueError):
        load_chat_model("foo:bar")
    auto = load_chat_model(f"openai:{real_server.base}/v1")  # the model id is read from /v1/models
    assert auto.model == MODEL and isinstance(auto, ChatModel)


def test_greedy_same_text_local_and_remote(remote, local):
    assert isinstance(local, LocalChatModel)
    for conv in CONVS:
        (a,) = remote.chat(conv, max_tokens=12, temperature=0)
        (b,) = local.chat(conv, max_tokens=12, temperature=0)
        assert isinstance(a, ChatResponse)
        assert (a.content, a.tool_calls, a.finish_reason) == (b.content, b.tool_calls, b.finish_reason)
        assert a.usage == b.usage


def test_seeded_sampling_and_n(remote, local):
    kw = {"max_tokens": 10, "temperature": 1.0, "seed": 5, "n": 2}
    a, b = remote.chat(HELLO, **kw), local.chat(HELLO, **kw)
    assert len(a) == len(b) == 2
    assert [r.content for r in a] == [r.content for r in b]
    batched = local.chat_batch(CONVS, max_tokens=10, temperature=0)
    assert [r[0].content for r in batched] == [local.chat(c, max_tokens=10, temperature=0)[0].content for c in CONVS]


def test_achat_concurrent(remote, local):
    async def main():
        remote_all = await asyncio.gather(*[remote.achat(HELLO, max_tokens=6, temperature=0) for _ in range(6)])
        local_one = await local.achat(HELLO, max_tokens=6, temperature=0)
        return remote_all, local_one

    remote_all, local_one = asyncio.run(main())
    assert {r[0].content for r in remote_all} == {local_one[0].content}


def test_tool_calls_through_openai_backend(scripted):
    from openk2.llm.openai_backend import OpenAIChatModel

    model = OpenAIChatModel(scripted.base + "/v1", model=MODEL, api_key=API_KEY)
    (r,) = model.chat(HELLO, tools=TOOLS, max_tokens=200)
    assert r.finish_reason == "tool_calls" and r.content == "Checking."
    assert r.tool_calls[0]["function"]["name"] == "get_weather"
    assert r.message()["tool_calls"] == r.tool_calls
