"""The RL loop with ``inference.engine: sglang``: GRPO steps whose rollouts go through SGLang's HTTP API.

The servers are embedded-engine servers (``tandem serve RECIPE --api sglang``) in deterministic mode, so
the exact contract must survive the HTTP hop: the server returns the engine's log-probs untouched and the
adapter's weight updates (a safetensors folder per step) reach it, so |train - rollout| is 0 at every step.
"""

from __future__ import annotations

from pathlib import Path

from tandem.config import load_config
from tandem.runtime.config import RunConfig
from tandem.runtime.loop import Run
from tandem.runtime.tracking import read_metrics
from tests.serve_helpers import serving

RECIPE = Path(__file__).parents[2] / "recipes" / "tiny" / "grpo-sync.yaml"


def _cfg(urls: list[str], *overrides: str) -> RunConfig:
    listed = ", ".join(f"'{u}'" for u in urls)
    return load_config(RunConfig, RECIPE, ["run.steps=3", "inference.engine=sglang",
                                           f"inference.sglang={{urls: [{listed}]}}",
                                           "trainer.fsdp.deterministic=true",
                                           "reward.terms=[{name: 'tests.runtime.rewards:even_tokens'}]", *overrides])


def test_three_grpo_steps_through_the_sglang_api_keep_the_exact_contract(tmp_path):
    with serving([str(RECIPE), "inference.torch.deterministic=true", "--api", "sglang"]) as url:
        run = Run(_cfg([url]), tmp_path)
        try:
            assert run.engine.info.name == "sglang" and run.engine.info.deterministic
            run.train()
            assert run.engine.weight_version == 3  # three syncs reached the server
        finally:
            run.close()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["train/grad_norm"] > 0
        assert r["train_rollout_logprob_abs_diff/max"] == 0.0, r


def test_grpo_through_sglang_router_with_two_replicas_keeps_the_exact_contract(tmp_path):
    """Rollouts through sglang-router (round robin over two deterministic servers, one /generate per sample);
    weight updates go to both servers (worker_urls): still |train - rollout| = 0 at every step."""
    import pytest

    from tests.engines.sglang_helpers import router_available, sglang_router

    if (reason := router_available()) is not None:
        pytest.skip(reason)
    serve = [str(RECIPE), "inference.torch.deterministic=true", "--api", "sglang"]
    with serving(serve) as one, serving(serve) as two, sglang_router([one, two]) as router:
        run = Run(_cfg([router], f"inference.sglang.worker_urls=['{one}', '{two}']", "run.steps=2"), tmp_path)
        try:
            run.train()
        finally:
            run.close()
        import httpx2 as httpx

        served = [httpx.get(f"{u}/get_server_info").json()["internal_states"][0]["generated_tokens"] for u in (one, two)]
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["train_rollout_logprob_abs_diff/max"] == 0.0 and r["train/grad_norm"] > 0 for r in rows), rows
    assert min(served) > 50  # both replicas generated rollouts


def test_lora_adapter_only_sync_through_the_sglang_api_keeps_the_exact_contract(tmp_path):
    """sync.lora_mode: adapter with SGLang: each sync is a peft folder the server loads (/load_lora_adapter) and a
    new weight version (/update_weight_version); rollouts use the newest adapter, and |train - rollout| stays 0."""
    lora = "trainer.fsdp.lora={rank: 4, alpha: 8.0, target_modules: [q_proj, v_proj, down_proj]}"
    with serving([str(RECIPE), "inference.torch.deterministic=true", "--api", "sglang"]) as url:
        run = Run(_cfg([url], "run.steps=2", lora, "sync.lora_mode=adapter", "trainer.fsdp.optimizer.lr=0.05"),
                  tmp_path)
        try:
            assert run.engine.info.lora_adapters and run.engine.config.lora_alpha == 8.0
            run.train(close=False)
            assert run.engine.weight_version == 2 and run.engine._lora == "tandem-v2"
        finally:
            run.close()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["train/grad_norm"] > 0
        assert r["train_rollout_logprob_abs_diff/max"] == 0.0, r
    # an adapter sync moves the adapters only: a small fraction of the model's bytes
    assert 0 < rows[-1]["sync/bytes"] < 0.2 * _model_bytes(), rows[-1]["sync/bytes"]


def _model_bytes() -> int:
    from tandem.models import resolve_model

    return sum(f.stat().st_size for f in resolve_model("tiny-llama").glob("*.safetensors"))


def _launched(*overrides: str) -> RunConfig:
    """``inference.sglang.launch: embedded``: the adapter starts its own server (no SGLang, nothing by hand)."""
    return load_config(RunConfig, RECIPE, ["inference.engine=sglang", "trainer.fsdp.deterministic=true",
                                           "inference.sglang={launch: embedded, server_args: {deterministic: true}}",
                                           "reward.terms=[{name: 'tests.runtime.rewards:even_tokens'}]", *overrides])


def test_a_run_that_launches_its_embedded_sglang_server_keeps_the_exact_contract(tmp_path):
    run = Run(_launched("run.steps=2"), tmp_path)
    try:
        [url] = run.engine.urls
        run.train(close=False)
        import httpx

        info = httpx.get(f"{url}/get_server_info", timeout=10).json()
        assert info["weight_version"] == "2" and info["tandem"]["pauses"] == 2  # each sync paused in place
    finally:
        run.close()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["train_rollout_logprob_abs_diff/max"] == 0.0 and r["train/grad_norm"] > 0 for r in rows), rows


def test_async_mode_through_a_launched_sglang_server_updates_between_rollouts_in_flight(tmp_path):
    """runtime.mode: fully_async with partial rollouts: every update pauses the server in place (requests in flight keep
    their tokens and cache) and continues it; the run completes every step and the server saw every sync."""
    run = Run(_launched("run.steps=3", "runtime.mode=fully_async", "algorithm.off_policy.mode=tis",
                        "runtime.max_staleness=1"), tmp_path)
    try:
        [url] = run.engine.urls
        run.train(close=False)
        import httpx

        info = httpx.get(f"{url}/get_server_info", timeout=10).json()
        assert info["weight_version"] == "3" and info["tandem"]["pauses"] == 3
        assert not info["internal_states"][0]["paused"]
    finally:
        run.close()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["train/grad_norm"] > 0 for r in rows), rows
