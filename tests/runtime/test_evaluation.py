"""Evaluation: the metrics (pass@k against its closed form), the evaluator on a real engine, `tandem eval`."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest

from tandem.cli import main
from tandem.config import ConfigError, load_config
from tandem.core.sample import Sample, SampleStatus
from tandem.runtime.config import RunConfig
from tandem.runtime.evaluation import EvalSetConfig, eval_metrics, pass_at_k

ROOT = Path(__file__).parents[2]
RECIPE = ROOT / "recipes" / "tiny" / "grpo-sync.yaml"
# an eval set of the recipe's task, a deterministic reward: even token ids in the response
SETS = ("eval.sets=[{name: held, n: 4, ks: [1, 2, 4], answer: last_number, max_prompts: 6, "
        "sampling: {temperature: 1.0, max_new_tokens: 8}, data: {max_prompt_tokens: 128, "
        "arithmetic: {seed: 7, num_examples: 32}}}, {name: greedy, max_prompts: 4, "
        "sampling: {max_new_tokens: 8}, data: {max_prompt_tokens: 128, arithmetic: {seed: 9}}}]")
EVEN = "reward.terms=[{name: 'tests.runtime.rewards:even_tokens'}]"


@pytest.mark.parametrize("n, c, k", [(n, c, k) for n in range(1, 7) for c in range(n + 1) for k in range(1, n + 1)])
def test_pass_at_k_is_the_chance_that_k_of_n_samples_hold_a_pass(n, c, k):
    """The closed form equals the fraction of the k-subsets of the n samples that hold a passing one."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(samples, k))
    expected = sum(any(s) for s in subsets) / len(subsets)
    assert math.isclose(pass_at_k(n, c, k), expected, rel_tol=1e-12)


def _sample(group: int, reward: float, response: str, status=SampleStatus.COMPLETED, length: int = 3) -> Sample:
    return Sample(prompt="p", response=response, tokens=[1] * (2 + length), response_length=length, reward=reward,
                  status=status, group_index=group, loss_mask=[1] * length, rollout_log_probs=[0.0] * length)


def test_eval_metrics_on_known_samples():
    samples = [  # prompt 0: answers 7, 7, 8, (none); only the 7s pass
        _sample(0, 1.0, "it is 7"), _sample(0, 1.0, "7"), _sample(0, 0.0, "8", SampleStatus.TRUNCATED),
        _sample(0, 0.0, "no idea"),
        # prompt 1: answers 3, 5, 5, 5: the majority (5) is wrong, one sample passes
        _sample(1, 1.0, "3"), _sample(1, 0.0, "5"), _sample(1, 0.0, "5"), _sample(1, 0.0, "5", length=7),
    ]
    m = eval_metrics(samples, ks=[1, 2, 4], answer="last_number")
    assert m["prompts"] == 2 and m["samples"] == 8
    assert m["reward_mean"] == pytest.approx(3 / 8)
    assert m["pass@1"] == pytest.approx((2 / 4 + 1 / 4) / 2)
    assert m["pass@2"] == pytest.approx((pass_at_k(4, 2, 2) + pass_at_k(4, 1, 2)) / 2)
    assert m["pass@4"] == 1.0
    # maj@1: the first sample's answer (prompt 0: 7 right, prompt 1: 3 right); maj@4: 7 right, 5 wrong
    assert m["maj@1"] == 1.0 and m["maj@4"] == 0.5
    # maj@2 of prompt 1: answers 3 and 5 tie; the first seen (3) wins and passes
    assert m["maj@2"] == 1.0
    assert m["truncated_frac"] == 1 / 8 and m["length_mean"] == pytest.approx((3 * 7 + 7) / 8)


def test_bad_eval_settings_name_the_value():
    with pytest.raises(ValueError, match=r"ks=\[5\]: each k must be in \[1, n=4\]"):
        EvalSetConfig(name="x", n=4, ks=[5])
    with pytest.raises(ConfigError, match="eval set name 'a' is used twice"):
        load_config(RunConfig, RECIPE, ["eval.sets=[{name: a}, {name: a}]"])
    with pytest.raises(ValueError, match="name='a b'"):
        EvalSetConfig(name="a b")


def _eval(target: str, out: Path, *extra: str) -> dict:
    assert main(["eval", target, SETS, EVEN, *extra, "--recipe", str(RECIPE), "--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_tandem_eval_is_seeded_and_takes_every_target_kind(tmp_path):
    from tandem.models import resolve_model
    from tandem.runtime.loop import Run

    first = _eval("tiny-llama", tmp_path / "a.json")
    again = _eval("tiny-llama", tmp_path / "b.json")
    assert first["kind"] == "model" and first["metrics"]["eval/held/prompts"] == 6
    assert {k: v for k, v in first["metrics"].items() if not k.startswith("time/")} == \
        {k: v for k, v in again["metrics"].items() if not k.startswith("time/")}  # same prompts, same seeds
    folder = _eval(str(resolve_model("tiny-llama")), tmp_path / "c.json")
    assert folder["kind"] == "model" and folder["metrics"]["eval/greedy/pass@1"] == first["metrics"]["eval/greedy/pass@1"]
    # a run trained a step: its directory, its checkpoint and the trainer checkpoint are targets too
    run_dir = tmp_path / "run"
    Run(load_config(RunConfig, RECIPE, [EVEN, "run.steps=1"]), run_dir).train()
    ckpt = run_dir / "checkpoints" / "step_1"
    results = {kind: _eval(str(path), tmp_path / f"{kind}.json") for kind, path in (
        ("run", run_dir), ("run_checkpoint", ckpt), ("trainer_checkpoint", ckpt / "trainer"))}
    for kind, res in results.items():
        assert res["kind"] == kind
        assert res["metrics"] == results["run"]["metrics"] | {"time/eval_s": res["metrics"]["time/eval_s"]}
    trained, base = results["run"]["metrics"], first["metrics"]
    assert trained["eval/held/reward_mean"] != base["eval/held/reward_mean"]  # the trained weights were used
    assert main(["eval", str(run_dir), SETS, EVEN, "--recipe", str(RECIPE)]) == 0  # default: beside the run
    assert (run_dir / "eval.json").is_file()
    # without --recipe a run is evaluated with the config it was trained with (its reward came from EVEN)
    for path in (run_dir, ckpt):
        assert main(["eval", str(path), SETS, "--out", str(tmp_path / "own.json")]) == 0
        own = json.loads((tmp_path / "own.json").read_text())["metrics"]
        assert own == results["run"]["metrics"] | {"time/eval_s": own["time/eval_s"]}


def test_tandem_eval_without_a_recipe_needs_a_run(tmp_path, capsys):
    from tandem.runtime.loop import Run

    assert main(["eval", "tiny-llama", SETS]) == 2
    assert "a model carries no recipe" in capsys.readouterr().err
    run_dir = tmp_path / "run"
    Run(load_config(RunConfig, RECIPE, ["run.steps=1"]), run_dir).train()
    assert main(["eval", str(run_dir / "checkpoints" / "step_1" / "trainer"), SETS]) == 2
    assert "a trainer checkpoint carries no recipe" in capsys.readouterr().err
    (run_dir / "config.yaml").unlink()  # the checkpoint's own copy (verified with it) is the one used
    assert main(["eval", str(run_dir), SETS]) == 0
    assert json.loads((run_dir / "eval.json").read_text())["metrics"]["eval/held/prompts"] == 6


def test_tandem_eval_refuses_what_is_not_a_target(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["eval", str(tmp_path / "empty"), SETS, "--recipe", str(RECIPE)]) == 2
    assert "is neither a run directory" in capsys.readouterr().err
    assert main(["eval", "tiny-llama", "--recipe", str(RECIPE)]) == 2
    assert "has no eval sets" in capsys.readouterr().err
    assert main(["eval", "tiny-llama", SETS, "--recipe", str(RECIPE), "--sets", "nope"]) == 2
    assert "no eval set 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["sync", "one_step_off", "fully_async"])
def test_the_loop_evaluates_before_every_n_steps_and_after(tmp_path, mode):
    from tandem.runtime.loop import Run
    from tandem.runtime.tracking import read_metrics

    extra = [] if mode == "sync" else ["algorithm.off_policy.mode=tis", "runtime.max_staleness=1"]
    cfg = load_config(RunConfig, RECIPE, [EVEN, SETS, "eval.every=2", "run.steps=3", f"runtime.mode={mode}", *extra])
    Run(cfg, tmp_path).train()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # the last row: the evaluation after the last step
    evaluated = [r["step"] for r in rows if "eval/held/pass@4" in r]
    assert evaluated == [0, 2, 3]  # before the first step, every 2 steps, after the last
    assert set(rows[-1]) == {"step", "time"} | {k for k in rows[-1] if k.startswith(("eval/", "time/eval"))}
    assert rows[0]["eval/held/prompts"] == 6 and rows[0]["eval/greedy/samples"] == 4
    if mode == "sync":  # the report: an eval plot, and the eval table in the summary and the HTML page
        assert main(["report", str(tmp_path)]) == 0
        page = (tmp_path / "report" / "report.html").read_text()
        assert "<h2>Eval sets</h2>" in page and "<th>held</th>" in page and "data:image/png;base64," in page
        assert (tmp_path / "report" / "eval.png").is_file()
        summary = (tmp_path / "report" / "summary.txt").read_text()
        assert "steps: 3" in summary and "'pass@1 (first)'" in summary


def test_export_and_resume_take_run_targets(tmp_path):
    from tandem.runtime.loop import Run
    from tandem.runtime.tracking import read_metrics

    run_dir = tmp_path / "run"
    Run(load_config(RunConfig, RECIPE, [EVEN, "run.steps=2", "run.save_every=1"]), run_dir).train()
    for i, target in enumerate((run_dir, run_dir / "checkpoints" / "step_1", run_dir / "checkpoints" / "step_2" / "trainer")):
        assert main(["export", str(target), str(tmp_path / f"out{i}")]) == 0
        assert (tmp_path / f"out{i}" / "model.safetensors").is_file() and (tmp_path / f"out{i}" / "config.json").is_file()
    assert main(["export", "tiny-llama", str(tmp_path / "nope")]) == 2  # a model is not a checkpoint
    # resume from an older checkpoint than the latest: the run continues from step 1
    assert main(["train", str(RECIPE), EVEN, "run.steps=3", "--quiet", "--resume",
                 str(run_dir / "checkpoints" / "step_1")]) == 0
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 1, 2]
