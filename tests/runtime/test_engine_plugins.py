"""Engines and generate functions as plug-ins: a third-party engine and generate function, named by import
path in a recipe, run every loop mode and `tandem serve` without an edit to Tandem."""

from __future__ import annotations

import json
from pathlib import Path

import httpx2 as httpx
import pytest
import torch

from tandem.config import ConfigError, load_config
from tandem.runtime.config import RunConfig
from tandem.runtime.loop import Run
from tandem.runtime.tracking import read_metrics
from tests.runtime import toy_engine
from tests.serve_helpers import serving

ROOT = Path(__file__).parents[2]
RECIPE = ROOT / "recipes" / "tiny" / "grpo-sync.yaml"
TOY = ["inference.engine=tests.runtime.toy_engine:ENTRY", "inference.toy.label=from-the-recipe",
       "rollout.generate=tests.runtime.toy_engine:tagged_single_turn", "rollout.dump=true", "run.steps=2",
       "reward.terms=[{name: 'tests.runtime.rewards:even_tokens'}]", "rollout.sampling.max_new_tokens=8"]
ASYNC = ["algorithm.off_policy.mode=tis", "runtime.max_staleness=1"]


def _weights(run: Run) -> dict[str, torch.Tensor]:
    return {n: t.clone() for b in run.trainer.named_parameters_for_sync(1 << 30) for n, t in b}


@pytest.mark.parametrize("mode", ["sync", "one_step_off", "fully_async"])
def test_a_plugin_engine_and_generate_function_run_every_mode(tmp_path, mode):
    toy_engine.GROUPS.clear()
    cfg = load_config(RunConfig, RECIPE, [*TOY, f"runtime.mode={mode}", *([] if mode == "sync" else ASYNC)])
    run = Run(cfg, tmp_path)
    assert isinstance(run.engine, toy_engine.ToyEngine)
    assert run.engine.health()["label"] == "from-the-recipe"  # the recipe's inference.toy section
    assert run.engine.info.name == "toy" and run.contract.relation == "bounded"
    assert run.contract.note.startswith("toy engine")  # the contract the entry registered
    before = _weights(run)
    run.train(close=False)
    after = _weights(run)
    engine = run.engine.named_weights()
    run.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1]
    assert any(not torch.equal(before[k], after[k]) for k in before), "no weight changed"
    assert all(torch.equal(engine[k], after[k]) for k in after)  # the toy engine holds the trained weights
    for step in (0, 1):
        rows = [json.loads(line) for line in (tmp_path / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()]
        assert rows and all(r["metadata"]["generated_by"] == "tagged_single_turn" for r in rows)
        assert {r["group_index"] for r in rows} <= set(toy_engine.GROUPS)


def test_a_plugin_engine_in_its_own_process(tmp_path):
    """The separate placement builds the plug-in from its entry's import path in the engine process."""
    cfg = load_config(RunConfig, RECIPE, [*TOY, "runtime.placement=separate", "sync.transport=broadcast",
                                          "sync.timeout_s=60"])
    with Run(cfg, tmp_path) as run:
        assert run.engine.info.name == "toy" and run.engine.health()["label"] == "from-the-recipe"
        run.train()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1] and rows[-1]["sync/version"] == 2


def test_refusals_name_the_setting_and_the_reason():
    with pytest.raises(ConfigError, match=r"rollout.recompute_log_probs: true needs a prefill pass .* which "
                                          r"inference.engine: toy cannot give; engines that have it: torch"):
        Run(load_config(RunConfig, RECIPE, [*TOY, "rollout.recompute_log_probs=true"]), "/nonexistent/never-made")
    with pytest.raises(ConfigError, match="unknown inference engine 'nope'"):
        load_config(RunConfig, RECIPE, ["inference.engine=nope"])
    with pytest.raises(ConfigError, match="inference.engine: .*cannot import module 'no_such_module'"):
        load_config(RunConfig, RECIPE, ["inference.engine=no_such_module:ENTRY"])
    with pytest.raises(ConfigError, match="is a training engine; this setting takes a inference engine|"
                                          "is a training engine"):
        load_config(RunConfig, RECIPE, ["inference.engine=tandem.engines.training.fsdp.entry:ENTRY"])
    with pytest.raises(ConfigError, match=r"unknown key 'inference.torhc' .*did you mean 'torch'"):
        load_config(RunConfig, RECIPE, ["inference.torhc.max_num_seqs=2"])
    with pytest.raises(ConfigError, match="inference.toy.label: expected a string"):
        load_config(RunConfig, RECIPE, [*TOY, "inference.toy.label=[1]"])


def test_the_saved_config_names_the_plugin_and_reloads(tmp_path):
    import yaml

    from tandem.config import from_dict, save_config

    cfg = load_config(RunConfig, RECIPE, TOY)
    save_config(cfg, tmp_path / "config.yaml")
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["inference"]["engine"] == "tests.runtime.toy_engine:ENTRY"
    assert saved["inference"]["toy"]["label"] == "from-the-recipe"
    assert from_dict(RunConfig, saved) == cfg


def test_tandem_serve_uses_the_recipes_engine():
    with serving([str(RECIPE), *TOY[:2]]) as base:
        sid = httpx.post(f"{base}/sessions").json()["id"]
        r = httpx.post(f"{base}/sessions/{sid}/v1/chat/completions", timeout=60,
                       json={"messages": [{"role": "user", "content": "What is 1 + 1?"}], "max_tokens": 3})
        assert r.status_code == 200
        engine = httpx.get(f"{base}/health").json()["engine"]
        assert engine["label"] == "from-the-recipe" and engine["generated_tokens"] >= 1
