"""A GRPO run with ``rollout.speculative``: the engine speculates, the exact contract still holds, and each
step logs the acceptance figures."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tandem.config import load_config
from tandem.runtime.config import RunConfig
from tandem.runtime.loop import Run
from tandem.runtime.tracking import read_metrics

RECIPE = Path(__file__).parents[2] / "recipes" / "tiny" / "grpo-sync.yaml"


def test_grpo_with_speculative_rollouts_keeps_the_exact_contract_and_logs_acceptance(tmp_path):
    cfg = load_config(RunConfig, RECIPE, ["run.steps=2", "rollout.speculative={k: 3, max_batch: null}", "trainer.fsdp.deterministic=true",
                                          "inference.torch.deterministic=true",
                                          "reward.terms=[{name: 'tests.runtime.rewards:even_tokens'}]"])
    run = Run(cfg, tmp_path)
    try:
        assert run.engine.config.speculative.k == 3  # rollout.speculative reached the engine
        run.train(close=False)
        assert run.engine.health()["spec_passes"] > 0
    finally:
        run.close()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["train_rollout_logprob_abs_diff/max"] == 0.0, r
        assert r["rollout/spec_passes"] > 0 and 0 <= r["rollout/spec_acceptance_rate"] <= 1
        assert r["rollout/spec_tokens_per_pass"] >= 1


def test_grpo_with_an_online_draft_head_logs_its_training(tmp_path):
    cfg = load_config(RunConfig, RECIPE, ["run.steps=3", "reward.terms=[{name: 'tests.runtime.rewards:even_tokens'}]",
                                          "rollout.speculative={drafter: draft_head, k: 3, max_batch: null, "
                                          "draft_vocab: 256}"])
    with Run(cfg, tmp_path) as run:
        run.train(close=False)
        health = run.engine.health()
    assert health["spec_head_trainings"] == 3  # one training per weight sync
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[0]["rollout/spec_passes"] == 0  # nothing to draft with before the first training
    assert rows[-1]["rollout/spec_passes"] > 0 and rows[-1]["rollout/spec_head_loss"] > 0


def test_a_resumed_run_keeps_its_draft_head(tmp_path):
    """The checkpoint keeps the trained head (``draft_head.safetensors``, in the manifest); the resumed run's
    engine gets it back and drafts from its first step, where a fresh engine drafts nothing."""
    head = ["reward.terms=[{name: 'tests.runtime.rewards:even_tokens'}]",
            "rollout.speculative={drafter: draft_head, k: 3, max_batch: null, draft_vocab: 256}"]
    with Run(load_config(RunConfig, RECIPE, ["run.steps=2", "run.save_every=2", *head]), tmp_path) as run:
        run.train(close=False)
        trained = run.engine.drafter_state()
    ckpt = tmp_path / "checkpoints" / "step_2"
    assert "draft_head.safetensors" in json.loads((ckpt / "manifest.json").read_text())["files"]
    assert int(trained["trainings"]) == 2
    with Run(load_config(RunConfig, RECIPE, ["run.steps=3", *head]), tmp_path, resume=True) as run:
        restored = run.engine.drafter_state()
        assert all(torch.equal(restored[k], trained[k]) for k in trained)
        run.train(close=False)
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[0]["rollout/spec_passes"] == 0 and rows[2]["rollout/spec_passes"] > 0  # drafts at once


def test_rollout_speculative_reaches_every_engine_in_its_own_terms():
    """The embedded engine takes the config; vLLM gets its n-gram speculative_config; SGLang servers the adapter
    launches get --speculative-algorithm NGRAM (real SGLang) or the config (embedded servers); settings of the
    engine's own section win."""
    from tandem.runtime import builders

    def filled(*overrides):
        cfg = load_config(RunConfig, RECIPE, ["rollout.speculative={k: 3, ngram_max: 2}", *overrides])
        return cfg.inference.entry.configure(builders.run_facts(cfg), cfg.inference.config)

    assert filled().speculative.k == 3 and filled().speculative.ngram_max == 2
    assert filled("inference.torch.speculative={k: 5}").speculative.k == 5
    assert filled("inference.engine=vllm").engine_kwargs["speculative_config"] == {
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    sglang = filled("inference.engine=sglang")
    assert sglang.server_args == {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 3}
    embedded = filled("inference.engine=sglang", "inference.sglang={launch: embedded}")
    assert embedded.server_args["speculative"]["k"] == 3
    running = filled("inference.engine=sglang", "inference.sglang={urls: ['http://127.0.0.1:1']}")
    assert running.server_args == {}  # servers started by someone else keep their own settings
