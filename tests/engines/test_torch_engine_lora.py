"""The embedded engine serves LoRA adapters unmerged (issue 20): per-request adapters in one batch, the
exact contract with the LoRA trainer, adapter-only sync, peft folders, clear refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tandem.cli import main as cli_main
from tandem.config import load_config
from tandem.core.protocols import GenerationRequest, SamplingParams
from tandem.engines.inference.torch import TorchEngine, TorchEngineConfig
from tandem.engines.training.fsdp import FSDPConfig, FSDPEngine, LoRAConfig, OptimizerConfig
from tandem.engines.training.fsdp.lora import hf_tensors
from tandem.models import ModelConfig, load_model
from tandem.runtime.config import RunConfig
from tandem.runtime.loop import Run
from tandem.runtime.tracking import read_metrics

from .torch_helpers import make_engine, prompts
from .training.helpers import make_batch, token_mean_pg

RECIPE = Path(__file__).parents[2] / "recipes" / "tiny" / "grpo-sync.yaml"
LORA = LoRAConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"), sync="adapter")


def _trained_adapter(seed: int = 0, dtype: str = "float32") -> list[tuple[str, torch.Tensor]]:
    """Adapter tensors of a LoRA trainer after one update (lora_B is no longer zero)."""
    torch.manual_seed(seed)
    trainer = FSDPEngine(FSDPConfig(model=ModelConfig(name="tiny-llama", dtype=dtype), lora=LORA, micro_batch_tokens=64,
                                    optimizer=OptimizerConfig(lr=5e-2), deterministic=True))
    trainer.train_step(make_batch(), token_mean_pg)
    tensors = list(hf_tensors(trainer.policy.module.lm, gather=lambda t: t.detach().clone(), adapter_only=True))
    trainer.close()
    return tensors


def _req(prompt, lora=None, seed=1, n=1):
    return GenerationRequest(prompt_token_ids=prompt, lora=lora,
                             sampling=SamplingParams(max_new_tokens=10, temperature=1.0, seed=seed, n=n))


def _out(result):
    assert result.error is None, result.error
    return [(c.token_ids, c.log_probs) for c in result.completions]


@pytest.fixture(scope="module")
def adapter():
    return _trained_adapter()


def test_rows_of_different_adapters_in_one_batch_get_exactly_their_own_results(adapter):
    eng = make_engine(deterministic=True, lora_alpha=8.0)
    other = [(n, t * -0.5) for n, t in adapter]
    eng.load_lora_adapter(adapter, version=1)
    eng.add_lora_adapter("other", other, alpha=8.0)
    ps = prompts([5, 9, 14, 7])
    alone_policy = [_out(eng.generate([_req(p, seed=i)])[0]) for i, p in enumerate(ps)]
    alone_other = [_out(eng.generate([_req(p, "other", seed=i)])[0]) for i, p in enumerate(ps)]
    alone_base = [_out(eng.generate([_req(p, "base", seed=i)])[0]) for i, p in enumerate(ps)]
    assert alone_policy != alone_base and alone_other != alone_base  # each adapter changes the model
    which = [None, "other", "base", None]
    mixed = eng.generate([_req(p, w, seed=i) for i, (p, w) in enumerate(zip(ps, which, strict=True))])
    want = [alone_policy[0], alone_other[1], alone_base[2], alone_policy[3]]
    assert [_out(r) for r in mixed] == want  # tokens and log-probs, bit for bit
    assert eng.lora_adapters()["policy"]["version"] == 1 and eng.weight_version == 1
    assert eng.lora_adapters()["other"]["rank"] == 4


def test_one_prompt_under_different_adapters_shares_no_prefill(adapter):
    """Requests of one prompt share its prefill only under the same adapter (keys/values differ)."""
    eng = make_engine(deterministic=True, lora_alpha=8.0)
    eng.load_lora_adapter(adapter, version=1)
    eng.add_lora_adapter("other", [(n, t * -0.5) for n, t in adapter], alpha=8.0)
    p = prompts([12])[0]
    which = [None, "other", "base", None]
    alone = [_out(eng.generate([_req(p, w, seed=i)])[0]) for i, w in enumerate(which)]
    before = eng.health()["prompt_tokens_computed"]
    mixed = eng.generate([_req(p, w, seed=i) for i, w in enumerate(which)])
    assert eng.health()["prompt_tokens_computed"] - before == 3 * len(p) + 1  # the two policy requests share
    assert [_out(r) for r in mixed] == alone


def test_adapter_log_probs_equal_the_lora_trainer_bit_for_bit(adapter):
    """The trainer scores the engine's samples with its peft adapters: the same bits (deterministic mode)."""
    torch.manual_seed(0)
    trainer = FSDPEngine(FSDPConfig(model=ModelConfig(name="tiny-llama"), lora=LORA, micro_batch_tokens=64,
                                    optimizer=OptimizerConfig(lr=5e-2), deterministic=True))
    trainer.train_step(make_batch(), token_mean_pg)
    tensors = list(hf_tensors(trainer.policy.module.lm, gather=lambda t: t.detach().clone(), adapter_only=True))
    eng = make_engine(deterministic=True, lora_alpha=8.0)
    eng.load_lora_adapter(tensors, version=1)
    results = eng.generate([_req(p, seed=i, n=2) for i, p in enumerate(prompts([6, 11, 3]))])
    from tandem.core.batch import TrainBatch
    from tandem.core.sample import Sample

    samples = [Sample(tokens=r.prompt_token_ids + c.token_ids, response_length=len(c.token_ids),
                      rollout_log_probs=c.log_probs, reward=0.0)
               for r, res in zip([_req(p) for p in prompts([6, 11, 3])], results, strict=True)
               for c in res.completions]
    batch = TrainBatch.from_samples(samples, pad_token_id=0)
    train_lp = trainer.forward_logprobs(batch).log_probs
    mask = batch.loss_mask.bool()
    assert torch.equal(train_lp[mask], batch.rollout_log_probs[mask])
    # the base model (adapter off) differs: the comparison is not vacuous
    base = eng.generate([_req(p, "base", seed=i, n=2) for i, p in enumerate(prompts([6, 11, 3]))])
    assert [_out(r) for r in base] != [_out(r) for r in results]
    trainer.close()


def test_bad_adapters_and_names_are_refused_and_the_engine_is_untouched(adapter):
    eng = make_engine(lora_alpha=8.0, max_loras=2)
    p = prompts([6])[0]
    before = _out(eng.generate([_req(p)])[0])
    with pytest.raises(ValueError, match="do not fit the base weight"):
        eng.load_lora_adapter([(n, t[:, :3] if "lora_A" in n else t) for n, t in adapter], version=1)
    with pytest.raises(ValueError, match="is not a peft LoRA tensor name"):
        eng.load_lora_adapter([("model.layers.0.self_attn.q_proj.weight", torch.zeros(2, 2))], version=1)
    with pytest.raises(ValueError, match="lora_A and lora_B must come together"):
        eng.load_lora_adapter([x for x in adapter if "lora_B" not in x[0]], version=1)
    with pytest.raises(ValueError, match="lora_max_rank=2"):
        make_engine(lora_alpha=8.0, lora_max_rank=2).load_lora_adapter(adapter, version=1)
    with pytest.raises(ValueError, match="reserved"):
        eng.add_lora_adapter("base", adapter, alpha=8.0)
    assert eng.lora_adapters() == {} and eng.weight_version == 0
    assert _out(eng.generate([_req(p)])[0]) == before
    eng.add_lora_adapter("a", adapter, alpha=8.0)
    eng.add_lora_adapter("b", adapter, alpha=8.0)
    with pytest.raises(ValueError, match="max_loras=2"):
        eng.add_lora_adapter("c", adapter, alpha=8.0)
    [bad] = eng.generate([_req(p, "nope")])
    assert "LoRA adapter 'nope' is not loaded (loaded: a, b" in bad.error
    with pytest.raises(ValueError, match="lora="):
        GenerationRequest(prompt_token_ids=p, lora="").check(vocab_size=512, max_model_len=64)
    eng.remove_lora_adapter("a")
    with pytest.raises(KeyError, match="no LoRA adapter 'a'"):
        eng.remove_lora_adapter("a")
    with pytest.raises(ValueError, match="lora_alpha is not set"):
        make_engine().load_lora_adapter(adapter, version=1)


def test_full_weights_replace_the_synced_adapter(adapter):
    eng = make_engine(deterministic=True, lora_alpha=8.0)
    p = prompts([8])[0]
    base = _out(eng.generate([_req(p)])[0])
    eng.load_lora_adapter(adapter, version=1)
    assert _out(eng.generate([_req(p)])[0]) != base
    eng.update_weights(list(eng.named_weights().items()), version=2)  # the same base weights, in full
    assert "policy" not in eng.lora_adapters() and _out(eng.generate([_req(p)])[0]) == base


def test_the_policy_adapter_is_merged_into_the_packed_weights_outside_the_deterministic_mode(adapter):
    """merge_lora (default): the synced adapter is folded into the packed float32 weights; policy rows,
    other adapters' rows and base rows give what the unmerged engine gives (rounding apart); sleep and
    wake keep it merged; removing it or a full update restores the base model's packed weights bit for bit."""
    merged, plain = make_engine(lora_alpha=8.0), make_engine(lora_alpha=8.0, merge_lora=False)
    ps, which = prompts([5, 9, 14, 7]), [None, "other", "base", None]

    def reqs(names=which):
        return [_req(p, w, seed=i) for i, (p, w) in enumerate(zip(ps, names, strict=True))]

    base_before = [_out(r) for r in merged.generate(reqs([None] * 4))]
    for eng in (merged, plain):
        eng.load_lora_adapter(adapter, version=1)
        eng.add_lora_adapter("other", [(n, t * -0.5) for n, t in adapter], alpha=8.0)
    assert merged.health()["lora_merged"] == "policy" and plain.health()["lora_merged"] is None
    got, want = [_out(r) for r in merged.generate(reqs())], [_out(r) for r in plain.generate(reqs())]
    for [(g_tok, g_lp)], [(w_tok, w_lp)] in zip(got, want, strict=True):
        assert g_tok == w_tok
        torch.testing.assert_close(torch.tensor(g_lp), torch.tensor(w_lp), atol=2e-5, rtol=0)
    assert got[0] != base_before[0] and got[1] != base_before[1]  # the adapters change the model
    merged.sleep()
    assert merged.health()["lora_merged"] is None
    merged.wake_up()
    assert merged.health()["lora_merged"] == "policy"
    assert [_out(r) for r in merged.generate(reqs())] == got  # packed merged again, the same bits
    merged.remove_lora_adapter("policy")
    assert merged.health()["lora_merged"] is None
    assert [_out(r) for r in merged.generate(reqs([None] * 4))] == base_before
    merged.load_lora_adapter(adapter, version=2)
    assert merged.health()["lora_merged"] == "policy"
    merged.update_weights(list(merged.named_weights().items()), version=3)  # the same base weights, in full
    assert merged.health()["lora_merged"] is None
    assert [_out(r) for r in merged.generate(reqs([None] * 4))] == base_before


@pytest.mark.parametrize("kw", [{"deterministic": True}, {"dtype": "bfloat16"}, {"pack_weights": False}])
def test_the_policy_adapter_stays_unmerged_where_merging_would_change_results(adapter, kw):
    """The deterministic mode's exact contract needs the unmerged sum; bfloat16 would round W + s·BA."""
    eng = make_engine(lora_alpha=8.0, **kw)
    eng.load_lora_adapter(adapter, version=1)
    assert eng.health()["lora_merged"] is None and eng.lora_adapters()["policy"]["version"] == 1


def test_a_peft_adapter_folder_from_tandem_export_is_served(tmp_path):
    """`tandem export --adapter-only` writes a peft folder; the engine serves it by name and its log-probs
    match the merged export's (a different computation: close, not equal)."""
    torch.manual_seed(0)
    trainer = FSDPEngine(FSDPConfig(model=ModelConfig(name="tiny-llama"), lora=LORA, micro_batch_tokens=64,
                                    optimizer=OptimizerConfig(lr=5e-2)))
    trainer.train_step(make_batch(), token_mean_pg)
    trainer.save(str(tmp_path / "ckpt"))
    trainer.close()
    assert cli_main(["export", str(tmp_path / "ckpt"), str(tmp_path / "ad"), "--adapter-only"]) == 0
    assert cli_main(["export", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "ad" / "adapter_config.json").read_text())["lora_alpha"] == 8.0
    eng = make_engine()
    eng.add_lora_adapter("mine", tmp_path / "ad")
    merged = TorchEngine(TorchEngineConfig(model=ModelConfig(name=str(tmp_path / "hf")), max_num_seqs=8,
                                           max_model_len=256))
    ps = prompts([7, 12])
    got = eng.generate([_req(p, "mine", seed=i) for i, p in enumerate(ps)])
    want = merged.score([(p + r.completions[0].token_ids, len(p)) for p, r in zip(ps, got, strict=True)])
    for r, w in zip(got, want, strict=True):
        assert max(abs(a - b) for a, b in zip(r.completions[0].log_probs, w, strict=True)) < 1e-4
    base = eng.score([(p + r.completions[0].token_ids, len(p)) for p, r in zip(ps, got, strict=True)])
    assert max(abs(a - b) for x, y in zip(base, want, strict=True) for a, b in zip(x, y, strict=True)) > 1e-3
    with pytest.raises(FileNotFoundError, match="not a peft adapter folder"):
        eng.add_lora_adapter("x", tmp_path / "hf")
    # the same folder loads in peft on the HF model, which gives the engine's log-probs
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tandem.core.batch import TrainBatch
    from tandem.core.sample import Sample
    from tandem.models import resolve_model

    from .training.helpers import hf_response_logprobs

    hf = AutoModelForCausalLM.from_pretrained(str(resolve_model("tiny-llama")), torch_dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, str(tmp_path / "ad")).eval()
    samples = [Sample(tokens=p + r.completions[0].token_ids, response_length=len(r.completions[0].token_ids),
                      reward=0.0) for p, r in zip(ps, got, strict=True)]
    batch = TrainBatch.from_samples(samples, pad_token_id=0)
    with torch.no_grad():
        ref = hf_response_logprobs(peft_model, batch)
    for k, r in enumerate(got):
        served = torch.tensor(r.completions[0].log_probs)
        assert torch.allclose(served, ref[k, : len(served)], atol=1e-4)


@pytest.mark.parametrize("placement", ["colocated", "separate"])
def test_a_lora_run_with_adapter_sync_keeps_the_exact_contract(tmp_path, placement):
    cfg = load_config(RunConfig, RECIPE, [
        "reward.terms=[{name: 'tests.runtime.rewards:even_tokens'}]", "inference.torch.deterministic=true",
        "trainer.fsdp.deterministic=true", "trainer.fsdp.lora={rank: 8, alpha: 16}", "sync.lora_mode=adapter",
        "trainer.fsdp.optimizer.lr=0.01", f"runtime.placement={placement}"])
    run = Run(cfg, tmp_path)
    assert run.contract.relation == "exact" and run.old_source == "rollout"
    run.train()
    rows = read_metrics(tmp_path)
    assert len(rows) == 3
    # after step 0 the adapters are trained (lora_B != 0), and the rollouts still match bit for bit
    assert all(r["train_rollout_logprob_abs_diff/max"] == 0.0 for r in rows)
    full_bytes = sum(p.numel() * 4 for p in load_model("tiny-llama").parameters())
    assert all(r["sync/bytes"] < 0.1 * full_bytes for r in rows)  # rank 8 of a 64-wide model: 6.7%
