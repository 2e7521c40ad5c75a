"""The recipes under recipes/<family>/ are what `tandem plan` writes: regenerating each with the command in its
header gives the same layout, so a change to the planner cannot leave a shipped recipe behind silently."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).parents[2]
PREFIX = "# regenerate: "
PLANNED = sorted(p for p in (ROOT / "recipes").rglob("*.yaml") if PREFIX + "tandem plan " in p.read_text())
FAMILIES = {"qwen3", "qwen3-moe", "llama3.1", "deepseek-v3", "glm4.5"}


def _command(path: Path) -> list[str]:
    line = next(ln for ln in path.read_text().splitlines() if ln.startswith(PREFIX))
    words = shlex.split(line.removeprefix(PREFIX))
    assert words[:2] == ["tandem", "plan"] and words[-2] == "--write", line
    assert (ROOT / words[-1]).resolve() == path.resolve(), f"{path}: the command writes {words[-1]}"
    return words[2:-2]


def _layout(recipe: dict) -> dict:
    return {
        key: recipe.get(key) for key in ("model", "trainer", "inference", "runtime", "ray", "rollout", "data")
    }


def test_every_family_has_planned_recipes():
    assert {p.parent.name for p in PLANNED} >= FAMILIES
    models = {yaml.safe_load(p.read_text())["model"]["name"] for p in PLANNED}
    assert {
        "Qwen/Qwen3-0.6B",
        "Qwen/Qwen3-8B",
        "Qwen/Qwen3-32B",
        "Qwen/Qwen3-30B-A3B",
        "Qwen/Qwen3-235B-A22B",
        "meta-llama/Llama-3.1-8B-Instruct",
        "meta-llama/Llama-3.1-70B-Instruct",
        "deepseek-ai/DeepSeek-V3",
        "zai-org/GLM-4.5-Air",
    } <= models


@pytest.mark.parametrize("path", PLANNED, ids=lambda p: str(p.relative_to(ROOT / "recipes")))
def test_regenerating_gives_the_same_recipe_layout(path: Path, tmp_path: Path, capsys):
    from tandem.cli import main

    out = tmp_path / path.name
    assert main(["plan", *_command(path), "--write", str(out)]) == 0, capsys.readouterr()
    shipped, fresh = yaml.safe_load(path.read_text()), yaml.safe_load(out.read_text())
    assert _layout(fresh) == _layout(shipped)
    header = [ln for ln in path.read_text().splitlines() if ln.startswith("# planned for: ")]
    assert header and header[0] in out.read_text().splitlines()  # the stated cluster and workload
