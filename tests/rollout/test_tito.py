"""Token-in-token-out trajectories: append-only ids, loss masks, trims, rollback and drift errors.

No engine here: model turns are token ids chosen by the test, so every expected value is written out.
"""

from __future__ import annotations

import pytest

from tandem.models import load_tokenizer
from tandem.models.tiny import CHATML_TEMPLATE, SPECIAL_TOKENS
from tandem.rollout.chat import ChatTemplate
from tandem.rollout.tito import HistoryMismatchError, TokenDriftError, Trajectory

SYSTEM = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
          "<|im_end|>\n")
EOS, ENDOFTEXT = 2, 0


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny-llama")


@pytest.fixture(scope="module")
def tpl(tok):
    return ChatTemplate(tok)


def _turn(traj: Trajectory, tpl: ChatTemplate, ids: list[int], finish: str = "stop") -> dict:
    return traj.add_model_turn(ids, [-0.25] * len(ids), finish_reason=finish, weight_versions=[3],
                               template=tpl, call_id_prefix="call_")


def test_turns_append_only_the_new_messages(tok, tpl):
    traj = Trajectory(stop_token_ids=frozenset({EOS}))
    user = {"role": "user", "content": "hi"}
    traj.prepare([user], None, tpl)
    first_prompt = SYSTEM + "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert traj.ids == tpl.encode(first_prompt)
    assert traj.loss_mask == [0] * len(traj.ids)
    model = tpl.encode("hello there") + [EOS]
    message = _turn(traj, tpl, model)
    assert message == {"role": "assistant", "content": "hello there"}
    before = list(traj.ids)
    assert traj.loss_mask == [0] * (len(before) - len(model)) + [1] * len(model)
    assert traj.log_probs[-len(model):] == [-0.25] * len(model)

    traj.prepare([user, message, {"role": "user", "content": "bye"}], None, tpl)
    assert traj.ids[: len(before)] == before  # never re-tokenized
    assert traj.ids[len(before):] == tpl.encode("\n<|im_start|>user\nbye<|im_end|>\n<|im_start|>assistant\n")
    assert traj.loss_mask == [0] * (len(before) - len(model)) + [1] * len(model) + [0] * (len(traj.ids) - len(before))
    # HF's own tokenization of the whole conversation agrees (the model's tokens are canonical here)
    hf = tok.apply_chat_template([user, message, {"role": "user", "content": "bye"}], add_generation_prompt=True,
                                 tokenize=True)
    assert traj.ids == list(hf["input_ids"] if hasattr(hf, "keys") else hf)
    assert traj.weight_versions() == [3]


def test_model_tokens_are_kept_even_when_a_fresh_tokenization_would_split_them_otherwise(tpl):
    traj = Trajectory(stop_token_ids=frozenset({EOS}))
    user = {"role": "user", "content": "what is it"}
    traj.prepare([user], None, tpl)
    split = tpl.encode("the an") + tpl.encode("swer") + [EOS]
    assert split[:-1] != tpl.encode("the answer"), "precondition: a non-canonical split"
    message = _turn(traj, tpl, split)
    start = traj.turns[0].start
    traj.prepare([user, message, {"role": "user", "content": "ok"}], None, tpl)
    assert traj.ids[start : start + len(split)] == split
    assert traj.stats["model_boundary_merges"] == 1  # counted, not an error


def test_a_truncated_turn_is_closed_by_the_next_render(tpl):
    traj = Trajectory(stop_token_ids=frozenset({EOS}))
    user = {"role": "user", "content": "hi"}
    traj.prepare([user], None, tpl)
    message = _turn(traj, tpl, tpl.encode("the sum"), finish="length")
    before = len(traj.text)
    traj.prepare([user, message, {"role": "user", "content": "go on"}], None, tpl)
    assert traj.text[before:] == "<|im_end|>\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n"


def test_a_foreign_stop_token_is_trimmed_and_rollback_restores_it(tpl):
    traj = Trajectory(stop_token_ids=frozenset({EOS, ENDOFTEXT}), max_trailing_trim=1)
    user = {"role": "user", "content": "hi"}
    traj.prepare([user], None, tpl)
    message = _turn(traj, tpl, tpl.encode("ok") + [ENDOFTEXT])  # the template closes turns with <|im_end|>
    snapshot = (list(traj.ids), list(traj.log_probs), traj.text, len(traj.messages), traj.turns[0].end)
    follow = [user, message, {"role": "user", "content": "more"}]
    traj.prepare(follow, None, tpl)
    end = traj.turns[0].end
    assert end == snapshot[4] - 1 and traj.stats["trimmed_tokens"] == 1
    assert traj.ids[:end] == snapshot[0][:-1]
    assert traj.text[len(snapshot[2]) - len("<|endoftext|>"):].startswith("<|im_end|>\n<|im_start|>user\nmore")
    _turn(traj, tpl, tpl.encode("fine") + [EOS])
    traj.rollback()
    assert (traj.ids, traj.log_probs, traj.text, len(traj.messages), traj.turns[0].end) == snapshot
    assert traj.stats["trimmed_tokens"] == 0 and traj.stats["rollbacks"] == 1


def test_without_a_trim_budget_a_foreign_stop_token_is_drift(tpl):
    traj = Trajectory(stop_token_ids=frozenset({EOS, ENDOFTEXT}), max_trailing_trim=0)
    user = {"role": "user", "content": "hi"}
    traj.prepare([user], None, tpl)
    message = _turn(traj, tpl, tpl.encode("ok") + [ENDOFTEXT])
    with pytest.raises(TokenDriftError) as e:
        traj.fork().prepare([user, message, {"role": "user", "content": "more"}], None, tpl)
    assert e.value.info["kind"] == "text"
    assert e.value.info["position"] == traj.turns[0].end - 1  # the <|endoftext|> token


REASONING_DROPPING = (
    "{% set ns = namespace(last_user=-1) %}{% for m in messages %}{% if m.role == 'user' %}"
    "{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and '</think>' in m.content and loop.index0 < ns.last_user %}"
    "{{ m.content.split('</think>')[-1].lstrip('\\n') }}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_that_drops_old_reasoning_is_reported_with_the_first_differing_token(tok):
    tpl = ChatTemplate(tok, chat_template=REASONING_DROPPING)
    traj = Trajectory(stop_token_ids=frozenset({EOS}))
    user = {"role": "user", "content": "q"}
    traj.prepare([user], None, tpl)
    message = _turn(traj, tpl, tpl.encode("<think>\nhmm\n</think>\n\nfour") + [EOS])
    work = traj.fork()
    with pytest.raises(TokenDriftError) as e:
        work.prepare([user, message, {"role": "user", "content": "and?"}], None, tpl)
    assert e.value.info["kind"] == "text"
    assert e.value.info["position"] == traj.turns[0].start  # "<think>" is where the renders part
    assert e.value.info["char_position"] == traj.spans[-1].char_start
    assert "token" in str(e.value) and "verify-template" in str(e.value)
    # the tool calls that continue the turn without a new user message keep the reasoning: no drift
    traj.prepare([user, message, {"role": "tool", "content": "4"}], None, tpl)


def _prefix_space_tokenizer():
    """A SentencePiece-style tokenizer: a space is prepended to the start of every encoded string."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    corpus = ["hello there\nuser assistant\nsystem bye\n what is the answer",
              "You are a helpful AI assistant named SmolLM, trained by Hugging Face"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL_TOKENS,
                                                        show_progress=False))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>",
                                 unk_token="<|endoftext|>", pad_token="<|im_end|>")
    hf.chat_template = CHATML_TEMPLATE
    return hf


def test_a_prefix_space_tokenizer_is_token_drift():
    tpl = ChatTemplate(_prefix_space_tokenizer())
    traj = Trajectory(stop_token_ids=frozenset({EOS}))
    user = {"role": "user", "content": "hello"}
    traj.prepare([user], None, tpl)
    message = _turn(traj, tpl, tpl.encode("there") + [EOS])
    env_start = len(traj.ids)
    with pytest.raises(TokenDriftError) as e:
        traj.fork().prepare([user, message, {"role": "user", "content": "bye"}], None, tpl)
    # the text matches (the decoder drops the prefix space); the tokens do not, at the new env span's start
    assert e.value.info == {**e.value.info, "kind": "tokens", "position": env_start}
    relaxed = Trajectory(stop_token_ids=frozenset({EOS}), verify_tokens=False)
    relaxed.prepare([user], None, tpl)
    message = _turn(relaxed, tpl, tpl.encode("there") + [EOS])
    relaxed.prepare([user, message, {"role": "user", "content": "bye"}], None, tpl)  # check off: accepted


def test_history_must_extend_the_stored_messages_and_a_repeat_is_a_retry(tpl):
    traj = Trajectory(stop_token_ids=frozenset({EOS}))
    user = {"role": "user", "content": "hi"}
    traj.prepare([user], None, tpl)
    message = _turn(traj, tpl, tpl.encode("yes") + [EOS])
    with pytest.raises(HistoryMismatchError, match=r"messages\[0\]"):
        traj.fork().prepare([{"role": "user", "content": "hey"}, message], None, tpl)
    with pytest.raises(HistoryMismatchError, match=r"messages\[1\]"):
        traj.fork().prepare([user, {"role": "assistant", "content": "no"}], None, tpl)
    prompt_len = traj.turns[0].start
    retry = traj.fork()
    new, retried = retry.prepare([user], None, tpl)  # the last turn's own request: resample it
    assert (new, retried) == (1, True)
    assert retry.turns == [] and retry.ids == traj.ids[:prompt_len] and retry.stats["rollbacks"] == 1
    # echoing the message back as a client does (a list of text parts, extra None fields) still matches
    echoed = {"role": "assistant", "content": [{"type": "text", "text": "yes"}], "tool_calls": None}
    traj.fork().prepare([user, echoed, {"role": "user", "content": "again"}], None, tpl)


def test_tools_are_fixed_by_the_first_turn(tpl):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    traj = Trajectory(stop_token_ids=frozenset({EOS}))
    user = {"role": "user", "content": "hi"}
    traj.prepare([user], tools, tpl)
    assert '"name": "f"' in traj.text  # rendered into the system message
    message = _turn(traj, tpl, tpl.encode("x") + [EOS])
    with pytest.raises(HistoryMismatchError, match="tools"):
        traj.fork().prepare([user, message, {"role": "user", "content": "y"}], None, tpl)


def test_tool_calls_are_parsed_and_the_raw_text_is_what_renders(tpl):
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]
    traj = Trajectory(stop_token_ids=frozenset({EOS}))
    user = {"role": "user", "content": "What is 3 + 4?"}
    traj.prepare([user], tools, tpl)
    raw = 'ok <tool_call>\n{"name": "calculator", "arguments": {"expression": "3 + 4"}}\n</tool_call>'
    model = tpl.encode(raw) + [EOS]
    message = _turn(traj, tpl, model)
    assert message["content"] == "ok"
    assert message["tool_calls"] == [{"id": "call_0_0", "type": "function", "function": {
        "name": "calculator", "arguments": '{"expression": "3 + 4"}'}}]
    assert traj.turns[0].num_tool_calls == 1
    result = {"role": "tool", "tool_call_id": "call_0_0", "content": "7"}
    before = list(traj.ids)
    traj.prepare([user, message, result], tools, tpl)
    assert traj.ids[: len(before)] == before
    assert traj.text.endswith(raw + "<|im_end|>\n<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n")


def test_rollback_without_turns_is_an_error():
    with pytest.raises(HistoryMismatchError, match="nothing to roll back"):
        Trajectory().rollback()
