"""The shipped calculator agent: its evaluator, and a few GRPO steps of the agentic loop on CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tandem.rollout.examples.calculator_agent import TOOL_BONUS, calculator, calculator_reward, evaluate
from tests.rollout.agentic_helpers import MODEL, QUESTION

RECIPE = Path(__file__).parents[2] / "recipes" / "tiny" / "calculator-agent-grpo.yaml"


@pytest.mark.parametrize("expression, value", [
    ("3 + 4", 7), ("12 * (3 + 4)", 84), ("-2 ** 3", -8), ("7 / 2", 3.5), ("8 / 2", 4), ("17 // 5 + 17 % 5", 5),
    ("  1.5 * 2 ", 3),
])
def test_evaluate(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize("expression, message", [
    ("__import__('os')", "unsupported"), ("x + 1", "unsupported"), ("2 ** 1000", "exponent"), ("1 / 0", "division"),
    ("3 +", "not an arithmetic"), ("1" * 300, "limit"), ("True + 1", "unsupported"),
])
def test_evaluate_rejects(expression, message):
    with pytest.raises(ValueError, match=message):
        evaluate(expression)


def test_calculator_tool_and_reward():
    assert calculator({"expression": "6 * 7"}) == "42"
    assert calculator.schema["function"]["parameters"]["required"] == ["expression"]

    class S:
        response, label, metadata = "so it is 42.", 42, {"num_tool_calls": 1}

    assert calculator_reward(S()) == 1 + TOOL_BONUS
    S.metadata = {"num_tool_calls": 0}
    S.response = "41"
    assert calculator_reward(S()) == 0.0


@pytest.fixture(scope="module")
def taught_model_dir(taught_calculator_model, tmp_path_factory):
    """The taught tiny model as an HF folder, so a recipe can name it."""
    from tandem.models import load_tokenizer

    path = tmp_path_factory.mktemp("taught") / "model"
    taught_calculator_model.save_pretrained(path)
    load_tokenizer(MODEL).save_pretrained(str(path))
    data = path.parent / "questions.jsonl"
    data.write_text(json.dumps({"prompt": QUESTION, "label": 7}) + "\n" + json.dumps({"prompt": QUESTION, "label": 8}) + "\n")
    return path


@pytest.mark.parametrize("variant", ["agentic_tool_call", "multi_turn"])
def test_grpo_trains_the_calculator_agent(tmp_path, taught_model_dir, variant):
    from tandem.config import load_config
    from tandem.runtime.config import RunConfig
    from tandem.runtime.loop import Run
    from tandem.runtime.tracking import read_metrics

    overrides = [f"model.name={taught_model_dir}", f"data.source={taught_model_dir.parent / 'questions.jsonl'}",
                 "rollout.dump=true", "rollout.sampling.temperature=1.6"]
    if variant == "multi_turn":
        overrides += ["rollout.generate=tandem.rollout.agent:multi_turn", "rollout.agent.function=null",
                      "rollout.agent.tools=[tandem.rollout.examples.calculator_agent:calculator]",
                      f"rollout.agent.system_prompt={json.dumps('You are a careful assistant. Use the calculator tool for arithmetic, then reply with only the final number.')}",
                      "reward.terms=[{name: 'tandem.rollout.examples.calculator_agent:calculator_reward'}]"]
    cfg = load_config(RunConfig, RECIPE, overrides)
    run = Run(cfg, tmp_path)
    before = {n: t.clone() for b in run.trainer.named_parameters_for_sync(1 << 30) for n, t in b}
    run.train(close=False)
    after = {n: t.clone() for b in run.trainer.named_parameters_for_sync(1 << 30) for n, t in b}
    run.close()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1]
    assert any(r["train/grad_norm"] > 0 for r in rows) and any(not torch.equal(before[k], after[k]) for k in before)
    dumped = [json.loads(line) for line in (tmp_path / "rollouts" / "step_0.jsonl").read_text().splitlines()]
    assert len(dumped) == 8 and {d["label"] for d in dumped} == {7, 8}
    multi = [d for d in dumped if 0 in d["loss_mask"]]
    assert multi, "no episode reached a tool result"
    for d in multi:  # the tool turn sits inside the response with loss mask 0, between model tokens
        mask = d["loss_mask"]
        assert mask[0] == 1 and mask[-1] == 1 and len(mask) == d["response_length"]
        assert all(lp == 0.0 for lp, m in zip(d["rollout_log_probs"], mask, strict=True) if m == 0)
