"""The config system: types, unknown keys, overrides, and the CLI's one-line errors (exit code 2)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest
import yaml

from tandem.config import ConfigError, apply_overrides, from_dict, load_config, save_config, to_dict
from tandem.runtime.config import RunConfig


@dataclass(kw_only=True, slots=True)
class Inner:
    lr: float = 1e-3
    mode: Literal["a", "b"] = "a"
    layers: list[int] = field(default_factory=list)


@dataclass(kw_only=True, slots=True)
class Outer:
    name: str
    steps: int = 1
    flag: bool = False
    inner: Inner = field(default_factory=Inner)
    extra: dict[str, float] = field(default_factory=dict)
    maybe: int | None = None

    def __post_init__(self):
        if self.steps < 1:
            raise ValueError(f"steps={self.steps} must be >= 1")


def test_from_dict_builds_nested_and_converts_int_to_float():
    cfg = from_dict(Outer, {"name": "x", "inner": {"lr": 1, "layers": [1, 2]}, "extra": {"k": 2}})
    assert cfg.inner.lr == 1.0 and isinstance(cfg.inner.lr, float)
    assert cfg.inner.layers == [1, 2] and cfg.extra == {"k": 2.0}


@pytest.mark.parametrize(
    "data, message",
    [
        (
            {"name": "x", "stepz": 2},
            "unknown key 'stepz' (valid keys: extra, flag, inner, maybe, name, steps); did you mean 'steps'?",
        ),
        (
            {"name": "x", "inner": {"mode": "c"}},
            "inner.mode: 'c' is not a valid choice (choose one of: a, b)",
        ),
        ({"name": "x", "steps": "3"}, "steps: expected an integer, got '3'"),
        ({"name": "x", "flag": 1}, "flag: expected true or false, got 1"),
        ({"name": "x", "steps": True}, "steps: expected an integer, got True"),
        ({"name": "x", "inner": {"layers": [1, "a"]}}, "inner.layers[1]: expected an integer, got 'a'"),
        ({"steps": 2}, "missing required key 'name'"),
        ({"name": "x", "steps": 0}, "Outer: steps=0 must be >= 1"),
        ({"name": "x", "maybe": "q"}, "maybe: expected an integer, got 'q'"),
        ({"name": "x", "inner": 3}, "inner: expected a mapping for Inner, got int 3"),
    ],
)
def test_from_dict_errors_name_the_key(data, message):
    with pytest.raises(ConfigError) as e:
        from_dict(Outer, data)
    assert str(e.value) == message


def test_overrides_parse_yaml_values_and_create_sections():
    d = apply_overrides({"a": {"b": 1}}, ["a.b=2.5", "a.c=[1, 2]", "x.y=true", "s=hello"])
    assert d == {"a": {"b": 2.5, "c": [1, 2]}, "x": {"y": True}, "s": "hello"}
    with pytest.raises(ConfigError, match="must look like dotted.key=value"):
        apply_overrides({}, ["novalue"])
    with pytest.raises(ConfigError, match="'a.b' is not a section"):
        apply_overrides({"a": {"b": 1}}, ["a.b.c=2"])


def test_round_trip_through_saved_yaml(tmp_path: Path):
    cfg = from_dict(Outer, {"name": "x", "inner": {"mode": "b", "layers": [3]}})
    p = save_config(cfg, tmp_path / "sub" / "config.yaml")
    again = load_config(Outer, p)
    assert again == cfg
    assert yaml.safe_load(p.read_text()) == to_dict(cfg)
    assert not list(p.parent.glob(".*tmp"))  # no temp file left behind


def test_bad_yaml_reports_line(tmp_path: Path):
    p = tmp_path / "bad.yaml"
    p.write_text("model:\n  name: [unclosed\n")
    with pytest.raises(ConfigError, match=r"invalid YAML \(line \d+"):
        load_config(RunConfig, p)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tandem", *args], capture_output=True, text=True)


RECIPE = Path(__file__).parents[1] / "recipes" / "tiny" / "grpo-sync.yaml"


@pytest.mark.parametrize(
    "args, message",
    [
        (
            (str(RECIPE), "run.sed=3"),
            "tandem: error: unknown key 'run.sed' (valid keys: keep_checkpoints, name, output_dir, save_every, seed, steps); did you mean 'seed'?",
        ),
        (
            (str(RECIPE), "model.dtype=int8"),
            "tandem: error: model.dtype: 'int8' is not a valid choice (choose one of: float32, bfloat16, float16)",
        ),
        ((str(RECIPE), "run.seed=abc"), "tandem: error: run.seed: expected an integer, got 'abc'"),
        (("missing.yaml",), "tandem: error: recipe file not found: missing.yaml"),
    ],
)
def test_cli_config_errors_are_one_line_exit_2(args, message):
    r = _cli("config", *args)
    assert r.returncode == 2
    assert r.stderr.strip() == message
    assert "Traceback" not in r.stderr


def test_cli_config_prints_resolved_config():
    r = _cli("config", str(RECIPE), "run.seed=7")
    assert r.returncode == 0, r.stderr
    assert yaml.safe_load(r.stdout)["run"]["seed"] == 7


def test_cli_overrides_may_follow_options():
    # `make demo DEMO_ARGS=key=value` runs `tandem train RECIPE --run-dir D key=value`
    r = _cli("config", str(RECIPE), "run.seed=7", "--debug", "run.steps=3", "run.seed=8")
    assert r.returncode == 0, r.stderr
    run = yaml.safe_load(r.stdout)["run"]
    assert run["seed"] == 8 and run["steps"] == 3  # the later override wins
    bad = _cli("config", str(RECIPE), "--debug", "--no-such-flag")
    assert bad.returncode == 2 and "unrecognized arguments: --no-such-flag" in bad.stderr
