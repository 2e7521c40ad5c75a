"""The vLLM adapter on real vLLM (CPU build): the shared contract on both backends, and what is vLLM's own.

One engine per backend for the whole module (``enforce_eager``: ~3 s to start in process, ~12 s for
the async engine's child process). Skipped, with the reason, where vLLM does not import.
"""

from __future__ import annotations

import pytest
import torch

from tests.engines.vllm_helpers import MAX_MODEL_LEN, make_vllm_engine, require_vllm, vllm_tiny_model

require_vllm()

from tandem.core.protocols import FinishReason, GenerationRequest, SamplingParams  # noqa: E402
from tests.engines.contract import EngineCase, InferenceEngineContract  # noqa: E402
from tests.engines.torch_helpers import prompts, requests, teacher_forced  # noqa: E402

# Measured: |vLLM fp32 log-prob - teacher-forced native fp32| <= ~1e-5 on this model (CPU); 10x margin.
LOGPROB_ATOL = 1e-4


def _case(backend: str):
    engine = make_vllm_engine(backend)
    return engine, EngineCase(engine=engine, model_path=vllm_tiny_model(), max_model_len=MAX_MODEL_LEN,
                              vocab_size=512, logprob_atol=LOGPROB_ATOL)


@pytest.fixture(scope="module")
def inprocess_case():
    engine, case = _case("inprocess")
    yield case
    engine.close()


@pytest.fixture(scope="module")
def async_case():
    engine, case = _case("async")
    yield case
    engine.close()


class TestInprocessContract(InferenceEngineContract):
    @pytest.fixture
    def case(self, inprocess_case):
        return inprocess_case


class TestAsyncContract(InferenceEngineContract):
    @pytest.fixture
    def case(self, async_case):
        return async_case


@pytest.fixture(params=["inprocess", "async"])
def any_case(request):
    return request.getfixturevalue(f"{request.param}_case")


def test_both_backends_sample_the_same_tokens(inprocess_case, async_case):
    ps = prompts([4, 9], seed=30)
    reqs = lambda: requests(ps, temperature=0.9, n=3, max_new_tokens=12, seed=7)  # noqa: E731
    a, b = inprocess_case.engine.generate(reqs()), async_case.engine.generate(reqs())
    assert [c.token_ids for r in a for c in r.completions] == [c.token_ids for r in b for c in r.completions]


def test_top_k_top_p_are_refused_unless_renormalized_log_probs_are_accepted(any_case):
    [res] = any_case.engine.generate(requests(prompts([5]), temperature=1.0, top_k=5, max_new_tokens=4))
    assert res.completions[0].finish_reason == FinishReason.ERROR
    assert "vLLM renormalises the returned log-prob" in res.error and "filtered_logprobs" in res.error
    # greedy ignores the filters, so it is accepted
    [greedy] = any_case.engine.generate(requests(prompts([5]), temperature=0, top_p=0.5, max_new_tokens=4))
    assert greedy.error is None


def test_renormalized_mode_returns_log_probs_over_the_kept_tokens():
    """With top-k = 5 vLLM's log-prob is log p(x) - log(mass of the 5 kept tokens) >= the full-vocab one."""
    ps = prompts([6, 11], seed=31)
    # a second engine in this process would share (and on close, tear down) vLLM's process-wide state
    with make_vllm_engine("async", filtered_logprobs="renormalized") as engine:
        results = engine.generate(requests(ps, temperature=1.0, top_k=5, max_new_tokens=10, seed=1))
    pairs = [(p, r.completions[0].token_ids) for p, r in zip(ps, results, strict=True)]
    from tandem.models.transformer import CausalLM

    ref = teacher_forced(CausalLM.from_pretrained(vllm_tiny_model(), dtype=torch.float32), pairs)
    for r, full in zip(results, ref, strict=True):
        got = torch.tensor(r.completions[0].log_probs)
        assert (got >= full - LOGPROB_ATOL).all() and (got > full + 1e-3).any()


def test_update_from_a_folder_and_partial_or_unknown_updates_are_rejected(any_case, tmp_path):
    from safetensors.torch import save_file

    engine = any_case.engine
    weights = any_case.checkpoint()
    v = engine.weight_version
    ps = prompts([7], seed=32)
    before = engine.generate(requests(ps, temperature=0, max_new_tokens=10))
    some = dict(list(weights.items())[:3])
    with pytest.raises(ValueError, match=r"weight\(s\) missing, e.g. .*send every weight of the model"):
        engine.update_weights(some.items(), version=v + 1)
    with pytest.raises(ValueError, match="unknown weight 'model.layers.7.mlp.up_proj.weight'"):
        engine.update_weights([*weights.items(), ("model.layers.7.mlp.up_proj.weight", torch.zeros(1))], v + 1)
    with pytest.raises(ValueError, match="dtype torch.int64 is not floating point"):
        engine.update_weights({**weights, "model.norm.weight": torch.ones(64, dtype=torch.long)}.items(), v + 1)
    save_file({k: t + 0.3 for k, t in weights.items()}, str(tmp_path / "model.safetensors"))
    engine.update_weights_from_path(tmp_path, version=v + 1)
    changed = engine.generate(requests(ps, temperature=0, max_new_tokens=10))
    engine.update_weights(weights.items(), version=v + 2)
    after = engine.generate(requests(ps, temperature=0, max_new_tokens=10))
    assert changed[0].completions[0].token_ids != before[0].completions[0].token_ids
    assert changed[0].completions[0].weight_versions == [v + 1]
    assert after[0].completions[0].token_ids == before[0].completions[0].token_ids


def test_moe_routing_is_refused_alone(any_case):
    [res] = any_case.engine.generate(requests(prompts([5]), return_routed_experts=True, max_new_tokens=3))
    assert res.completions[0].finish_reason == FinishReason.ERROR and "routed experts" in res.error


def test_health_reports_the_backend_and_device(any_case):
    health = any_case.engine.health()
    assert health["backend"] in ("inprocess", "async") and health["device"] == "cpu"
    assert health["dtype"] == "float32" and health["generated_tokens"] > 0


def test_lora_adapter_is_served_by_name_and_equals_merged_weights():
    """Adapter-only sync: vLLM serving base + LoRA gives the log-probs of the merged weights."""
    from tandem.models.transformer import CausalLM
    from tandem.sync.apply import WeightApplier

    base = CausalLM.from_pretrained(vllm_tiny_model(), dtype=torch.float32)
    weights = base.hf_state_dict()
    rank, alpha = 4, 8.0
    g = torch.Generator().manual_seed(3)
    adapter, merged = [], {k: v.clone() for k, v in weights.items()}
    for layer in range(2):
        for proj in ("q_proj", "v_proj"):
            module = f"model.layers.{layer}.self_attn.{proj}"
            out_dim, in_dim = weights[f"{module}.weight"].shape
            a = 0.3 * torch.randn(rank, in_dim, generator=g)
            b = 0.3 * torch.randn(out_dim, rank, generator=g)
            adapter += [(f"base_model.model.{module}.lora_A.weight", a), (f"base_model.model.{module}.lora_B.weight", b)]
            merged[f"{module}.weight"] += (alpha / rank) * b @ a
    ps = prompts([6, 13], seed=33)
    with make_vllm_engine("async", lora_alpha=alpha, lora_max_rank=8) as engine:
        plain = engine.generate(requests(ps, temperature=0, max_new_tokens=12))
        WeightApplier(engine)(adapter, version=1)  # what the sync layer does with an adapter-only update
        assert engine.weight_version == 1 and engine.health()["lora"] == "tandem-v1"
        served = engine.generate(requests(ps, temperature=1.0, max_new_tokens=12, seed=2))
        with pytest.raises(ValueError, match="lora_A and lora_B must come together"):
            engine.load_lora_adapter(adapter[:1], version=2)
        # per request: the base model by name; another adapter name is refused alone
        base_again = engine.generate([GenerationRequest(prompt_token_ids=p, lora="base",
                                                        sampling=SamplingParams(temperature=0, max_new_tokens=12))
                                      for p in ps])
        [other] = engine.generate([GenerationRequest(prompt_token_ids=ps[0], lora="other")])
    assert other.error and "serves only the synced adapter" in other.error
    assert [r.completions[0].token_ids for r in base_again] == [r.completions[0].token_ids for r in plain]
    assert [r.completions[0].weight_versions for r in served] == [[1], [1]]
    pairs = [(p, r.completions[0].token_ids) for p, r in zip(ps, served, strict=True)]
    with torch.no_grad():
        for name, t in base.hf_state_dict().items():
            t.copy_(merged[name])
    for r, ref in zip(served, teacher_forced(base, pairs), strict=True):
        torch.testing.assert_close(torch.tensor(r.completions[0].log_probs), ref, rtol=0, atol=1e-3)
    assert [r.completions[0].token_ids for r in plain] != [r.completions[0].token_ids for r in served]


def test_a_tandem_export_adapter_only_folder_loads_in_vllm(tmp_path):
    """`tandem export --adapter-only` of a trained LoRA checkpoint is a peft folder vLLM loads as an adapter;
    served on the base weights it gives the log-probs of the merged export."""
    from tandem.cli import main as cli_main
    from tandem.engines.training.fsdp import FSDPConfig, FSDPEngine, LoRAConfig, OptimizerConfig
    from tandem.models import ModelConfig
    from tandem.models.transformer import CausalLM
    from tests.engines.training.helpers import make_batch, token_mean_pg

    torch.manual_seed(0)
    lora = LoRAConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))
    trainer = FSDPEngine(FSDPConfig(model=ModelConfig(name=str(vllm_tiny_model())), lora=lora, micro_batch_tokens=64,
                                    optimizer=OptimizerConfig(lr=5e-2)))
    trainer.train_step(make_batch(), token_mean_pg)
    trainer.save(str(tmp_path / "ckpt"))
    trainer.close()
    assert cli_main(["export", str(tmp_path / "ckpt"), str(tmp_path / "ad"), "--adapter-only"]) == 0
    assert cli_main(["export", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0
    ps = prompts([6, 13], seed=35)
    with make_vllm_engine("async", lora_alpha=8.0, lora_max_rank=8) as engine:
        plain = engine.generate(requests(ps, temperature=0, max_new_tokens=12))
        engine.load_lora_adapter_from_path(tmp_path / "ad", version=1)
        served = engine.generate(requests(ps, temperature=1.0, max_new_tokens=12, seed=4))
    merged = CausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    pairs = [(p, r.completions[0].token_ids) for p, r in zip(ps, served, strict=True)]
    for r, ref in zip(served, teacher_forced(merged, pairs), strict=True):
        torch.testing.assert_close(torch.tensor(r.completions[0].log_probs), ref, rtol=0, atol=1e-3)
    base = CausalLM.from_pretrained(vllm_tiny_model(), dtype=torch.float32)
    gaps = [(torch.tensor(r.completions[0].log_probs) - ref).abs().max().item()
            for r, ref in zip(served, teacher_forced(base, pairs), strict=True)]
    assert max(gaps) > 1e-2, gaps  # the adapter changed the model: the comparison above is not vacuous
    assert [r.completions[0].weight_versions for r in served] == [[1], [1]]
    assert plain  # the engine served the base before the adapter


def test_a_batch_over_the_step_token_budget_samples_as_its_requests_alone(any_case):
    """3,200 prompt tokens > vLLM's 2,048-token step budget. With chunked prefill vLLM would split a prompt
    and then rewind that request's seeded sampler, which a CPU generator cannot do (every request failed
    with "CPU Generator does not use offset"); the adapter turns chunked prefill off on CPU."""
    ps = prompts([200] * 16, seed=34)
    together = any_case.engine.generate(requests(ps, temperature=1.0, max_new_tokens=6, seed=5))
    assert [r.error for r in together] == [None] * 16
    alone = [any_case.engine.generate(requests([p], temperature=1.0, max_new_tokens=6, seed=5))[0] for p in ps[:3]]
    assert [r.completions[0].token_ids for r in alone] == [r.completions[0].token_ids for r in together[:3]]
