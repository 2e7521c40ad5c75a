"""The `openai` package, unchanged, drives a full tool-calling episode against the session server.

The engine runs tiny-llama taught (in the test session) to answer the calculator question with a
``<tool_call>`` block and, after the tool result, with the answer; so the tool-call path runs end to end
on a real engine: parsing, OpenAI ``tool_calls``, the tool message, streaming deltas, error mapping.
"""

from __future__ import annotations

import json

import httpx2 as httpx
import openai
import pytest

from tandem.rollout.examples.calculator_agent import SYSTEM_PROMPT, calculator
from tandem.rollout.server import create_app
from tests.rollout.agentic_helpers import QUESTION, ThreadedServer, make_engine, make_store


@pytest.fixture(scope="module")
def server(taught_calculator_model):
    engine = make_engine(taught_calculator_model, max_num_seqs=4)
    store = make_store(engine)
    with ThreadedServer(create_app(store)) as srv:
        yield srv, store
    engine.close()


def _session(base_url: str) -> str:
    return httpx.post(f"{base_url}/sessions").json()["id"]


def test_openai_client_runs_a_tool_calling_episode(server):
    srv, store = server
    sid = _session(srv.base_url)
    client = openai.OpenAI(base_url=f"{srv.base_url}/sessions/{sid}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": QUESTION}]
    first = client.chat.completions.create(model="tiny", messages=messages, tools=[calculator.schema],
                                           temperature=0, logprobs=True)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "calculator"
    assert json.loads(call.function.arguments) == {"expression": "3 + 4"}
    assert choice.message.content is None
    assert all(t.logprob <= 0 for t in choice.logprobs.content)
    messages.append(choice.message)  # the pydantic message object itself, as agents commonly do
    messages.append({"role": "tool", "tool_call_id": call.id, "content": calculator(json.loads(call.function.arguments))})

    stream = client.chat.completions.create(model="tiny", messages=messages, tools=[calculator.schema],
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "The answer is 7"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    assert chunks[-1].usage.completion_tokens == len(store.template.encode("The answer is 7")) + 1  # + <|im_end|>

    view = httpx.get(f"{srv.base_url}/sessions/{sid}").json()
    assert len(view["turns"]) == 2 and view["turns"][0]["num_tool_calls"] == 1
    tool_tokens = view["token_ids"][view["turns"][0]["end"] : view["turns"][1]["start"]]
    assert store.template.decode(tool_tokens) == "\n<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n"
    assert view["loss_mask"][view["turns"][0]["end"] : view["turns"][1]["start"]] == [0] * len(tool_tokens)
    assert view["messages"][-1] == {"role": "assistant", "content": "The answer is 7"}


def test_openai_client_streams_tool_calls(server):
    srv, _ = server
    sid = _session(srv.base_url)
    client = openai.OpenAI(base_url=f"{srv.base_url}/sessions/{sid}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": QUESTION}]
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, tools=[calculator.schema],
                                                 temperature=0, stream=True))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "calculator"
    assert json.loads(calls[0].function.arguments) == {"expression": "3 + 4"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_openai_client_sees_errors_as_its_exceptions(server):
    srv, _ = server
    missing = openai.OpenAI(base_url=f"{srv.base_url}/sessions/none/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError, match="no session"):
        missing.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    sid = _session(srv.base_url)
    client = openai.OpenAI(base_url=f"{srv.base_url}/sessions/{sid}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.UnprocessableEntityError, match="stop"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], stop=["x"])
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    with pytest.raises(openai.ConflictError, match=r"messages\[0\]"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "changed"},
                                                               reply.choices[0].message])
