"""Issue 23, clear errors: bad recipes and values are one line naming the value and the limit, exit 2, no
traceback unless --debug."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tandem.cli import main
from tandem.config import ConfigError, read_yaml
from tandem.rollout.data import DataConfig, DataError, DataSource

RECIPE = Path(__file__).parents[1] / "recipes" / "tiny" / "grpo-sync.yaml"


def _error(capsys, *argv: str) -> str:
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tandem: error: "), err
    return lines[0]


# -- duplicate keys ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, key, line", [
    ("run:\n  seed: 1\n  name: a\n  seed: 2\n", "run.seed", 4),
    ("a: 1\na: 2\n", "a", 2),
    ("reward:\n  terms:\n    - {name: x, name: y}\n", "reward.terms[0].name", 3),
])
def test_a_duplicate_key_is_refused_with_its_path_and_line(tmp_path, text, key, line):
    (tmp_path / "r.yaml").write_text(text)
    with pytest.raises(ConfigError, match=re.escape(f"duplicate key '{key}' at line {line}")):
        read_yaml(tmp_path / "r.yaml")


def test_anchors_and_merge_keys_are_not_duplicates(tmp_path):
    (tmp_path / "r.yaml").write_text("base: &b {x: 1, y: 2}\nother:\n  <<: *b\n  y: 3\nagain: *b\n")
    assert read_yaml(tmp_path / "r.yaml") == {"base": {"x": 1, "y": 2}, "other": {"x": 1, "y": 3},
                                              "again": {"x": 1, "y": 2}}


def test_a_duplicate_key_in_an_override_is_refused(capsys):
    line = _error(capsys, "config", str(RECIPE), "reward.terms=[{name: number, name: format}]")
    assert "override 'reward.terms=[{name: number, name: format}]': duplicate key '[0].name'" in line


def test_cli_duplicate_key_is_one_line_and_debug_shows_the_traceback(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE.read_text() + "run:\n  seed: 5\n")  # a second top-level 'run'
    assert "duplicate key 'run' at line" in _error(capsys, "config", str(recipe))
    for argv in (["--debug", "config", str(recipe)], ["config", str(recipe), "--debug"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "Traceback" in err and err.strip().splitlines()[-1].startswith("tandem: error: ")


# -- values with limits -----------------------------------------------------------------------------------


@pytest.mark.parametrize("override, expected", [
    ("rollout.sampling.max_new_tokens=1000000000", "max_new_tokens=1000000000 is above the limit of 1000000"),
    ("rollout.sampling.max_new_tokens=1e9", "rollout.sampling.max_new_tokens: expected an integer, got '1e9'"),
    ("rollout.sampling.max_new_tokens=1.0e+9", "expected an integer, got 1000000000.0"),
    ("rollout.sampling.temperature=.nan", "temperature=nan must be a finite number"),
    ("rollout.sampling.top_k=-1", "top_k=-1 must be >= 0"),
])
def test_sampling_values_outside_their_limits(capsys, override, expected):
    assert expected in _error(capsys, "config", str(RECIPE), override)


def test_a_missing_data_file_is_a_one_line_error(tmp_path, capsys):
    with pytest.raises(DataError, match="data.source: data file not found"):
        DataSource(DataConfig(source=str(tmp_path / "nope.jsonl")), tokenizer=None)
    with pytest.raises(DataError, match="data.source: dataset folder not found"):
        DataSource(DataConfig(source=f"hf:{tmp_path / 'nope'}"), tokenizer=None)
    line = _error(capsys, "train", str(RECIPE), f"data.source={tmp_path / 'nope.jsonl'}",
                  "--run-dir", str(tmp_path / "run"))
    assert line == f"tandem: error: data.source: data file not found: {tmp_path / 'nope.jsonl'}"


# -- start-up refusals through `tandem train` ---------------------------------------------------------------


@pytest.mark.parametrize("overrides, expected", [
    (["algorithm.contract.expect=exact"], "needs: "),  # fp32 engine vs trainer without determinism: bounded
    (["algorithm.advantage.estimator=gae", "trainer.engine=megatron"], "megatron"),
    (["trainer.fsdp.routing_replay=true"], "dense model"),
])
def test_startup_refusals_are_one_line(tmp_path, capsys, overrides, expected):
    line = _error(capsys, "train", str(RECIPE), "run.steps=1", *overrides, "--run-dir", str(tmp_path / "run"))
    assert expected in line


def test_models_prepare_without_a_name_and_a_missing_debug_dump_are_one_line_errors(tmp_path, capsys):
    from tandem.cli import main

    assert main(["models", "prepare"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.strip() == "tandem: error: 'tandem models prepare' needs a model name"
    recipe = str(Path(__file__).parents[1] / "recipes" / "tiny" / "grpo-sync.yaml")
    assert main(["train", recipe, "--debug-train-only", str(tmp_path / "nodump"), "--run-dir",
                 str(tmp_path / "run"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--debug-train-only" in err and "no rollout dump there" in err and "\n" not in err
