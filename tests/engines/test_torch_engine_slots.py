"""How many sequences the embedded engine decodes together: set, left to the run, or the standalone default."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.config import load_config
from tandem.engines.inference.torch.config import (
    DEFAULT_MAX_NUM_SEQS,
    KV_BUDGET_TOKENS,
    TorchEngineConfig,
    auto_num_seqs,
)
from tandem.runtime import builders
from tandem.runtime.config import RunConfig

from .torch_helpers import make_engine

ROOT = Path(__file__).parents[2]
TINY = ROOT / "recipes" / "tiny" / "grpo-sync.yaml"
DEMO = ROOT / "recipes" / "smollm2-135m" / "addition-grpo.yaml"


def _filled(recipe: Path, *overrides: str) -> TorchEngineConfig:
    cfg = load_config(RunConfig, recipe, list(overrides))
    return cfg.inference.entry.configure(builders.run_facts(cfg), cfg.inference.config)


def test_auto_num_seqs_is_the_rollout_batch_within_the_default_and_the_cache_budget():
    assert auto_num_seqs(64, 96) == 64
    assert auto_num_seqs(128, 96) == 128
    assert auto_num_seqs(8, 96) == DEFAULT_MAX_NUM_SEQS  # never fewer slots than an engine of its own has
    assert auto_num_seqs(0, 96) == DEFAULT_MAX_NUM_SEQS  # no rollout (tandem serve MODEL)
    assert auto_num_seqs(10_000, 96) == KV_BUDGET_TOKENS // 96  # a huge batch: within the cache budget
    assert auto_num_seqs(64, 2048) == DEFAULT_MAX_NUM_SEQS  # long context: the default's memory, not more
    assert auto_num_seqs(64, 1024) == 64
    assert auto_num_seqs(64, 4096) == DEFAULT_MAX_NUM_SEQS  # the floor holds where the budget gives fewer


def test_a_run_sizes_the_slots_to_its_rollout_batch_unless_the_recipe_sets_them():
    demo = _filled(DEMO)  # 8 prompts x 8 samples, prompt 64 + 32 new tokens
    assert (demo.max_num_seqs, demo.max_model_len) == (64, 96)
    assert _filled(DEMO, "rollout.prompts_per_step=16").max_num_seqs == 128
    assert _filled(DEMO, "rollout.n_samples_per_prompt=2").max_num_seqs == DEFAULT_MAX_NUM_SEQS
    assert _filled(DEMO, "inference.torch.max_num_seqs=8").max_num_seqs == 8  # the recipe's value is kept
    assert _filled(DEMO, "inference.torch.max_num_seqs=100").max_num_seqs == 100
    long = _filled(DEMO, "rollout.sampling.max_new_tokens=1984")  # 2,048-token slots
    assert (long.max_num_seqs, long.max_model_len) == (DEFAULT_MAX_NUM_SEQS, 2048)
    assert demo.cache_tokens == 64 * 96


def test_with_several_replicas_each_engine_gets_slots_for_its_share_of_a_round():
    """The router spreads a round's requests over the replicas (fewest outstanding first): each engine's slots
    are sized for its share (rounded up), not the whole round; the floor of an engine of its own still holds."""
    big = ("rollout.prompts_per_step=32",)  # 32 x 8 = 256 sequences a round
    assert _filled(DEMO, *big).max_num_seqs == 256
    assert _filled(DEMO, *big, "inference.replicas=2").max_num_seqs == 128
    assert _filled(DEMO, *big, "inference.replicas=3").max_num_seqs == 86  # ceil(256 / 3)
    assert _filled(DEMO, "inference.replicas=2").max_num_seqs == DEFAULT_MAX_NUM_SEQS  # 64 / 2 = 32: the floor
    assert _filled(DEMO, *big, "inference.replicas=2", "inference.torch.max_num_seqs=40").max_num_seqs == 40


def test_the_engine_allocates_the_slots_it_is_given_or_the_default(tmp_path):
    with make_engine(max_num_seqs=None, max_model_len=64) as engine:  # unset, and no run to size it
        assert engine.config.max_num_seqs is None and engine.cache.num_slots == DEFAULT_MAX_NUM_SEQS
    filled = _filled(TINY, "rollout.prompts_per_step=12", "rollout.n_samples_per_prompt=4")  # 48 sequences
    assert filled.max_num_seqs == 48
    from tandem.runtime.loop import Run

    cfg = load_config(RunConfig, TINY, ["rollout.prompts_per_step=12", "rollout.n_samples_per_prompt=4", "run.steps=1",
                                        "run.save_every=0"])
    run = Run(cfg, tmp_path)
    try:
        assert run.engine.health()["num_slots"] == 48
        peak = 0
        step = run.engine._step

        def counting(plan):  # how many sequences each engine step carries
            nonlocal peak
            peak = max(peak, len(plan.sequences))
            step(plan)

        run.engine._step = counting
        run.train(close=False)
    finally:
        run.close()
    assert peak == 48  # the whole rollout batch decoded together, not in waves of the old default 32


@pytest.mark.parametrize("value", [0, -3, True])
def test_a_bad_max_num_seqs_is_refused_naming_it(value):
    with pytest.raises(ValueError, match=f"max_num_seqs={value} must be >= 1"):
        TorchEngineConfig(max_num_seqs=value)
