"""The chat-template verifier: SmolLM2's template passes; templates written here that reproduce the
known failure patterns are caught, each by the right check, with the construct named."""

from __future__ import annotations

import pytest

from tandem.cli import main
from tandem.models import load_tokenizer
from tandem.models.tiny import CHATML_TEMPLATE
from tandem.rollout.chat import ChatTemplate
from tandem.rollout.template_check import VerifyConfig, random_conversation, verify_template
from tests.rollout.test_tito import REASONING_DROPPING

CHATML_TAIL = "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
LAST_ASSISTANT_THINKS = (  # Qwen3-like: only the last assistant message carries an (empty) think block
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if loop.last and m.role == 'assistant' %}"
    "<think>\n\n</think>\n\n{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}" + CHATML_TAIL)
STRIPS_CONTENT = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | trim }}<|im_end|>\n{% endfor %}" + CHATML_TAIL
THINKING_GENERATION_PROMPT = (  # enable_thinking=False style: the generation prompt opens an empty block
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n\n</think>\n\n{% endif %}")
NO_SEPARATOR = ("{% for m in messages %}{{ m.role }}:{{ m.content }}{% endfor %}"
                "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny-llama")


def _report(tok, source, n=60):
    return verify_template(ChatTemplate(tok, chat_template=source), VerifyConfig(num_conversations=n))


def test_smollm2_template_is_prefix_stable(tok):
    # the tiny models carry SmolLM2-135M-Instruct's template verbatim (tandem/models/tiny.py)
    report = _report(tok, CHATML_TEMPLATE, n=300)
    assert report.ok, report.format()
    assert all(report.counts[k] > 300 for k in report.counts)


@pytest.mark.slow
@pytest.mark.ci
def test_smollm2_tokenizer_and_template_are_prefix_stable():
    template = ChatTemplate(load_tokenizer("smollm2-135m-instruct"))
    assert template.source == CHATML_TEMPLATE and not template.native_tools
    report = verify_template(template, VerifyConfig(num_conversations=300))
    assert report.ok, report.format()


def test_random_conversations_cover_every_construct():
    import random

    rng = random.Random(0)
    seen = set()
    for _ in range(200):
        msgs, tools = random_conversation(rng, VerifyConfig())
        seen |= {m["role"] for m in msgs}
        seen |= {"tools"} if tools else set()
        seen |= {"tool_calls" for m in msgs if m.get("tool_calls")}
        seen |= {"reasoning" for m in msgs if "<think>" in (m.get("content") or "")}
        seen |= {"multi_turn" for _ in [0] if sum(m["role"] == "assistant" for m in msgs) > 1}
    assert seen == {"system", "user", "assistant", "tool", "tools", "tool_calls", "reasoning", "multi_turn"}


@pytest.mark.parametrize("source, check, construct", [
    (LAST_ASSISTANT_THINKS, "string_prefix", "loop.last"),
    (REASONING_DROPPING, "string_prefix", "reasoning blocks are dropped from earlier turns"),
    (STRIPS_CONTENT, "generation_prompt", "| trim"),
    (THINKING_GENERATION_PROMPT, "generation_prompt", "the generation prompt differs"),
    (NO_SEPARATOR, "token_prefix", "a token merges across the boundary"),
], ids=["loop.last", "reasoning-dropped", "strip", "generation-prompt", "token-merge"])
def test_known_failure_patterns_are_caught_and_explained(tok, source, check, construct):
    report = _report(tok, source)
    assert not report.ok and report.failures[check] > 0
    divergence = report.first[check]
    assert construct in divergence.construct
    text = divergence.format()
    assert text.startswith(f"FAIL {check}") and "construct:" in text and "conversation:" in text
    assert divergence.char_position is not None and divergence.token_position is not None


def test_loop_last_divergence_points_at_the_last_message(tok):
    d = _report(tok, LAST_ASSISTANT_THINKS).first["string_prefix"]
    assert d.message_index == d.prefix_len - 1 and d.messages[d.message_index]["role"] == "assistant"
    assert d.prefix_excerpt.split(">>>")[1].strip().startswith("'<think>")


def test_cli_verify_template(tok, tmp_path, capsys):
    assert main(["verify-template", "tiny-llama", "--num-conversations", "20"]) == 0
    assert "20 random conversations" in capsys.readouterr().out
    bad = tmp_path / "bad.jinja"
    bad.write_text(LAST_ASSISTANT_THINKS)
    assert main(["verify-template", str(bad), "--num-conversations", "20"]) == 1
    out = capsys.readouterr().out
    assert "FAIL string_prefix" in out and "loop.last" in out
    assert main(["verify-template", "tiny-llama", "--num-conversations", "0"]) == 2
    assert "num_conversations=0" in capsys.readouterr().err
