"""Every shipped recipe loads and validates against the run config schema."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.config import load_config
from tandem.runtime.config import RunConfig

RECIPES = sorted((Path(__file__).parents[1] / "recipes").rglob("*.yaml"))
REGENERATE = "# regenerate: tandem plan "  # the header `tandem plan --write` puts on the recipes it writes


def test_there_are_recipes():
    assert RECIPES


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: str(p.relative_to(p.parents[1])))
def test_recipe_validates(path: Path):
    cfg = load_config(RunConfig, path)
    assert cfg.model.name


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: str(p.relative_to(p.parents[1])))
def test_recipe_model_is_known(path: Path):
    from tandem.models import list_models
    from tandem.plan.archs import ARCHS

    name = load_config(RunConfig, path).model.name
    if name in list_models() or (Path(name) / "config.json").is_file():
        return
    # A hub id (no download here) only in a recipe `tandem plan` wrote for a GPU cluster, and only one of the
    # planner's architecture table (tests/plan/test_family_recipes.py regenerates these recipes).
    assert name in ARCHS and REGENERATE in path.read_text(), name
