"""The multi_turn and agentic_tool_call generate functions: samples, rewards, failures and limits."""

from __future__ import annotations

import math

import pytest

from tandem.core.sample import SampleStatus
from tandem.models import load_tokenizer
from tandem.rollout.agent import AgentConfig, agent_metrics, agent_reward, agentic_tool_call, multi_turn
from tandem.rollout.data import PromptRecord
from tandem.rollout.examples.calculator_agent import SYSTEM_PROMPT
from tandem.rollout.functions import generate_groups
from tandem.rollout.generate import SamplingConfig
from tandem.runtime.config import RolloutConfig
from tests.rollout.agentic_helpers import MODEL, QUESTION, make_engine
from tests.rollout.test_tito import REASONING_DROPPING

TOOL_TURN = "\n<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n"
GREEDY = SamplingConfig(temperature=0, max_new_tokens=40)
P = "tests.rollout.agent_plugins"


@pytest.fixture(scope="module")
def engine(taught_calculator_model):
    eng = make_engine(taught_calculator_model, max_num_seqs=8)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(MODEL)


def _records(k: int = 1) -> list[PromptRecord]:
    return [PromptRecord(index=i, prompt=QUESTION, prompt_token_ids=[1, 2, 3], label=7, metadata={"src": i})
            for i in range(k)]


def _run(fn, engine, tok, *, n=1, sampling=GREEDY, records=None, **agent):
    cfg = RolloutConfig(agent=AgentConfig(**agent))
    return generate_groups(fn.__name__, engine, records or _records(), n=n, sampling=sampling, tokenizer=tok, seed=0,
                           step=0, first_group=5, config=cfg)


def _check_sample(s) -> None:
    s.validate()
    for m, lp in zip(s.loss_mask, s.rollout_log_probs, strict=True):
        assert (lp == 0.0) if m == 0 else (lp <= 0 and math.isfinite(lp))


def test_agentic_tool_call_trajectory_samples(engine, tok):
    samples = _run(agentic_tool_call, engine, tok, n=2, function=f"{P}:calculator_episode")
    assert [s.group_index for s in samples] == [5, 5] and [s.index for s in samples] == [0, 1]
    for s in samples:
        _check_sample(s)
        assert s.status == SampleStatus.COMPLETED and s.response == "The answer is 7"
        assert s.metadata["agent_reward"] == pytest.approx(1.2) and agent_reward(s) == pytest.approx(1.2)
        assert s.metadata["num_turns"] == 2 and s.metadata["num_tool_calls"] == 1 and s.metadata["src"] == 0
        response = s.response_tokens
        env = [t for t, m in zip(response, s.loss_mask, strict=True) if m == 0]
        assert tok.decode(env) == TOOL_TURN  # the tool result is in the response, not trained on
        assert tok.decode(response).endswith("</tool_call><|im_end|>" + TOOL_TURN + "The answer is 7<|im_end|>")
        assert tok.decode(s.prompt_tokens).startswith("<|im_start|>system\n" + SYSTEM_PROMPT)
        assert s.weight_versions == [0]
    assert agent_metrics(samples) == {"agent/turns_mean": 2.0, "agent/tool_calls_mean": 1.0}


def test_agentic_tool_call_one_sample_per_turn(engine, tok):
    samples = _run(agentic_tool_call, engine, tok, function=f"{P}:calculator_episode", samples="turn")
    first, second = samples
    for s in samples:
        _check_sample(s)
        assert s.loss_mask == [1] * s.response_length and s.metadata["agent_reward"] == pytest.approx(1.2)
    assert tok.decode(first.response_tokens).startswith("<tool_call>")
    assert second.tokens[: len(first.tokens)] == first.tokens  # the whole history is the prompt
    assert tok.decode(second.prompt_tokens).endswith(TOOL_TURN)
    assert tok.decode(second.response_tokens) == "The answer is 7<|im_end|>"
    assert [s.metadata["turn"] for s in samples] == [0, 1]


def test_multi_turn_runs_the_tools_itself(engine, tok):
    [s] = _run(multi_turn, engine, tok, tools=["tandem.rollout.examples.calculator_agent:calculator"],
               system_prompt=SYSTEM_PROMPT)
    _check_sample(s)
    assert s.response == "The answer is 7" and s.metadata["num_tool_calls"] == 1
    assert tok.decode([t for t, m in zip(s.response_tokens, s.loss_mask, strict=True) if m == 0]) == TOOL_TURN


def test_multi_turn_tool_errors_are_observations(engine, tok):
    # the calculator raises: the model sees the error as the tool's result and the episode goes on
    [s] = _run(multi_turn, engine, tok, tools=[f"{P}:broken_calculator"], system_prompt=SYSTEM_PROMPT, max_turns=2)
    text = tok.decode(s.response_tokens)
    assert "<|im_start|>tool\nerror: ZeroDivisionError: boom<|im_end|>" in text
    assert s.metadata["num_turns"] == 2
    assert s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)


def test_multi_turn_environment_replies_as_the_user(engine, tok):
    [s] = _run(multi_turn, engine, tok, environment=f"{P}:asks_twice",
               sampling=SamplingConfig(temperature=0, max_new_tokens=6))
    _check_sample(s)
    assert s.metadata["num_turns"] == 2
    assert "<|im_start|>user\nAre you sure?<|im_end|>" in tok.decode(s.response_tokens)


def test_timeouts_are_retried_then_aborted(engine, tok):
    [s] = _run(agentic_tool_call, engine, tok, function=f"{P}:sleepy_agent", timeout_s=0.3, max_retries=1)
    assert s.status == SampleStatus.ABORTED
    assert s.metadata["status_reason"] == "timeout" and s.metadata["attempt_reasons"] == ["timeout", "timeout"]
    [s] = _run(agentic_tool_call, engine, tok, function=f"{P}:slow_async_agent", timeout_s=0.2, max_retries=0)
    assert s.metadata["attempt_reasons"] == ["timeout"]
    assert agent_metrics([s]) == {"agent/aborted/timeout": 1.0, "agent/turns_mean": 0.0, "agent/tool_calls_mean": 0.0}


def test_agent_and_environment_failures_are_aborted_with_their_reason(engine, tok):
    [s] = _run(agentic_tool_call, engine, tok, function=f"{P}:failing_agent", max_retries=2)
    assert s.status == SampleStatus.ABORTED and s.metadata["attempt_reasons"] == ["agent_error"] * 3
    [s] = _run(multi_turn, engine, tok, environment=f"{P}:broken_environment", max_retries=0,
               sampling=SamplingConfig(temperature=0, max_new_tokens=4))
    assert s.status == SampleStatus.ABORTED and s.metadata["status_reason"] == "environment_error"
    [s] = _run(agentic_tool_call, engine, tok, function=f"{P}:wrong_type_agent")
    assert s.status == SampleStatus.FAILED and "expected a number, str, dict or None" in s.metadata["error"]


def test_drift_aborts_with_its_reason(engine, tok, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text(REASONING_DROPPING)
    [s] = _run(agentic_tool_call, engine, tok, function=f"{P}:drifting_agent", chat_template=str(template),
               max_retries=0)
    assert s.status == SampleStatus.ABORTED and s.metadata["status_reason"] == "token_drift"


def test_async_agents_get_the_session_url_and_metadata(engine, tok):
    from tests.rollout import agent_plugins

    agent_plugins.CALLS.clear()
    samples = _run(agentic_tool_call, engine, tok, n=2, function=f"{P}:async_agent", records=_records(2))
    assert len(samples) == 4 and all(s.status != SampleStatus.ABORTED for s in samples)
    assert sorted((c["metadata"]["prompt_index"], c["metadata"]["sample_index"]) for c in agent_plugins.CALLS) == [
        (0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(c["metadata"]["label"] == 7 and "/sessions/" in c["base_url"] for c in agent_plugins.CALLS)
    assert len({c["base_url"] for c in agent_plugins.CALLS}) == 4  # one session each
    assert all(s.response == s.response.strip() or s.response for s in samples)


def test_a_full_context_truncates_the_episode(engine, tok):
    from tandem.rollout.chat import ChatTemplate
    from tandem.rollout.examples.calculator_agent import calculator

    template = ChatTemplate(tok)
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": QUESTION}]
    prompt_len = len(template.encode(template.render(messages, [calculator.schema], add_generation_prompt=True)))
    [s] = _run(agentic_tool_call, engine, tok, function=f"{P}:calculator_episode", max_context_tokens=prompt_len + 10)
    assert s.status == SampleStatus.TRUNCATED and s.metadata["status_reason"] == "context_full"
    assert len(s.tokens) == prompt_len + 10 and s.response_length == 10
    assert agent_metrics([s])["agent/truncated/context_full"] == 1.0


def test_bad_agent_settings_are_rejected():
    with pytest.raises(ValueError, match="max_turns=0"):
        AgentConfig(max_turns=0)
    with pytest.raises(ValueError, match="import path"):
        AgentConfig(function="no_colon")
    with pytest.raises(ValueError, match="timeout_s"):
        AgentConfig(timeout_s=0)
    with pytest.raises(ValueError, match="not a file"):
        AgentConfig(chat_template="/nonexistent.jinja")
    with pytest.raises(ValueError, match="agent.function is not set"):
        generate_groups("agentic_tool_call", None, _records(), n=1, sampling=GREEDY, tokenizer=object(),
                        config=RolloutConfig())
