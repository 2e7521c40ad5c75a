"""MegatronEngine in one process against HF references on the tiny models (fp32): the contract of
tests/engines/training/test_fsdp_engine.py, plus conversion parity, the CPU shims and the SDPA core attention."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip(
    "megatron.core", reason="megatron-core is not installed (pip install 'tandem-rl[megatron]')"
)

from tandem.core.protocols import LogProbOutput, TrainingEngine  # noqa: E402
from tandem.engines.training.megatron import (  # noqa: E402
    MegatronConfig,
    MegatronEngine,
    MegatronParallelConfig,
    MegatronRefConfig,
    OptimizerConfig,
    convert,  # noqa: E402
)
from tandem.engines.training.megatron.attention import _causal  # noqa: E402
from tandem.models import ModelConfig, load_model, resolve_model  # noqa: E402

from ..training.helpers import (  # noqa: E402
    GROUPED,
    EntropyBonusLoss,
    NaNOnCall,
    global_scale,
    hf_response_logprobs,
    make_batch,
    max_abs_diff,
    seq_mean_pg,
    sync_weights,
    token_mean_pg,
)

OPT = OptimizerConfig(lr=1e-3, eps=1e-4, grad_clip=1.0, weight_decay=0.01)  # eps: see test_fsdp_engine
FAMILIES = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe"]


@pytest.fixture
def build():
    """Engines built through this factory are closed after the test (Megatron's state is process-global)."""
    engines: list[MegatronEngine] = []
    had_group = torch.distributed.is_initialized()

    def make(name: str = "tiny-qwen3", lr_lambda=None, dtype: str = "float32", **kw) -> MegatronEngine:
        kw.setdefault("optimizer", OPT)
        kw.setdefault("micro_batch_tokens", 20)
        kw.setdefault("vocab_divisible_by", 96)  # 512 -> 576: padded vocabulary columns exist
        model = ModelConfig(name=name, dtype=dtype)
        engines.append(MegatronEngine(MegatronConfig(model=model, **kw), lr_lambda=lr_lambda))
        return engines[-1]

    yield make
    for e in engines:
        e.close()
    # the world-size-1 group an engine creates (and Megatron's state) goes with the last engine,
    # also when a build failed half-way
    assert torch.distributed.is_initialized() == had_group


def _hf_checkpoint(name: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(next(resolve_model(name).glob("*.safetensors"))))


def hf_grads(engine: MegatronEngine) -> dict[str, torch.Tensor]:
    """The policy's gradients under HF names (one process: every parameter is whole)."""
    grads = {name: p.grad for name, _, p in engine.params}
    pairs = convert.export_megatron_to_hf(engine.policy.layout, lambda rule: grads[rule.megatron])
    return {k: v.clone() for k, v in pairs}


# -- conversion ---------------------------------------------------------------------------------------


def _check_conversion(engine: MegatronEngine, name: str) -> None:
    """Megatron logits equal HF's on random tokens (fp32); export gives back the checkpoint bit for bit."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (3, 17), generator=g)
    mask = torch.triu(torch.ones(17, 17, dtype=torch.bool), 1)[None, None]
    with torch.no_grad():
        ours = engine.policy.module(ids, torch.arange(17).expand(3, 17), mask)
        ref = load_model(name)(input_ids=ids).logits
    assert ours.shape == (3, 17, 576)  # the padded vocabulary
    scale = ref.abs().max()
    assert scale > 1.0 and (ours[..., :512] - ref).abs().max() < 2e-6 * scale
    exported = sync_weights(engine)
    original = _hf_checkpoint(name)
    assert set(exported) == set(original)  # HF checkpoint names (a tied head stays out)
    assert all(torch.equal(exported[k], original[k]) for k in original)


@pytest.mark.parametrize("name", FAMILIES)
def test_converted_model_gives_hf_logits_and_exports_the_same_bits(build, name):
    _check_conversion(build(name), name)


def test_moe_model_with_dense_layers_converts_layer_by_layer(build, tmp_path):
    from transformers import AutoModelForCausalLM

    from tandem.models.tiny import tiny_config

    config = tiny_config("qwen3_moe", 512)
    config.mlp_only_layers = [1]  # Qwen3-MoE's dense layers
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp_path))
    engine = build(str(tmp_path))
    assert [type(layer.mlp).__name__ for layer in engine.policy.module.decoder.layers] == ["MoELayer", "MLP"]
    _check_conversion(engine, str(tmp_path))


# -- the training-engine contract ---------------------------------------------------------------------


def test_satisfies_protocol_and_logprobs_match_hf(build):
    engine = build(micro_batch_tokens=24)
    assert isinstance(engine, TrainingEngine)
    batch = make_batch()
    out = engine.forward_logprobs(batch, with_entropy=True)
    with torch.no_grad():
        hf = load_model("tiny-qwen3")
        ref = hf_response_logprobs(hf, batch)
    assert out.log_probs.shape == batch.loss_mask.shape
    assert (out.log_probs - ref).abs().max() < 1e-5
    valid = torch.arange(batch.loss_mask.shape[1])[None, :] < batch.response_lengths[:, None]
    assert (out.log_probs[~valid] == 0).all() and (out.entropy[~valid] == 0).all()
    assert (out.entropy[valid] > 0).all()
    hot = build(temperature=0.7).forward_logprobs(batch)
    with torch.no_grad():
        assert (hot.log_probs - hf_response_logprobs(hf, batch, 0.7)).abs().max() < 1e-5


@pytest.mark.parametrize("loss_fn", [token_mean_pg, seq_mean_pg], ids=["token-mean", "seq-mean"])
def test_micro_batched_step_equals_full_batch_reference(build, loss_fn):
    batch = make_batch()
    engine = build("tiny-qwen2")
    stats = engine._accumulate_gradients(batch, loss_fn)
    assert len(engine._stage_batches(batch, engine_plan(engine, batch))) > 2  # really micro-batched
    hf = load_model("tiny-qwen2").train()
    loss, _ = loss_fn(LogProbOutput(log_probs=hf_response_logprobs(hf, batch)), batch, global_scale(batch))
    loss.backward()
    assert abs(stats.loss - float(loss)) < 1e-6
    # Megatron attends with baddbmm + softmax over the padded length, HF with SDPA: fp32 rounding apart
    assert max_abs_diff(hf_grads(engine), {n: p.grad for n, p in hf.named_parameters()}) < 1e-5
    norm = torch.nn.utils.clip_grad_norm_(hf.parameters(), OPT.grad_clip)
    torch.optim.AdamW(
        hf.parameters(), lr=OPT.lr, betas=OPT.betas, eps=OPT.eps, weight_decay=OPT.weight_decay
    ).step()
    metrics = engine._finish_step(stats, 0.0)
    # ours is summed in float64 over gradients that differ from HF's by up to 1e-5 each (above): 1.1e-6 of the norm
    # on an AVX2-only EPYC, where the float32 kernels sum in another order than on AVX-512
    assert abs(metrics["train/grad_norm"] - float(norm)) < 1e-5 * float(norm)
    assert abs(metrics["pg/loss"] - float(loss)) < 1e-6  # metric shares sum to the global value
    assert metrics["train/skipped_step"] == 0.0 and metrics["train/lr"] == OPT.lr
    assert max_abs_diff(sync_weights(engine), dict(hf.state_dict())) < 1e-6


def engine_plan(engine, batch):
    from tandem.engines.training.common import plan_micro_batches

    return plan_micro_batches(batch, engine.config.micro_batch_tokens)


def test_nan_loss_skips_the_step_and_leaves_state_untouched(build):
    batch = make_batch()
    engine = build()
    engine.train_step(batch, token_mean_pg)
    before = sync_weights(engine)
    adam = engine.optim.optimizers[0].state_dict()["state"]
    adam_before = {k: {n: t.clone() for n, t in v.items()} for k, v in adam.items()}
    metrics = engine.train_step(batch, NaNOnCall(k=1))
    assert metrics["train/skipped_step"] == 1.0 and math.isnan(metrics["train/loss"])
    assert max_abs_diff(sync_weights(engine), before) == 0.0
    adam_after = engine.optim.optimizers[0].state_dict()["state"]
    assert all(torch.equal(adam_before[k][n], adam_after[k][n]) for k in adam_before for n in adam_before[k])
    assert engine.step == 2
    assert engine.train_step(batch, token_mean_pg)["train/skipped_step"] == 0.0


def test_metrics_reduce_by_convention_and_entropy_reaches_the_loss(build):
    batch = make_batch()
    whole = build(micro_batch_tokens=200).train_step(batch, token_mean_pg)
    split = build(micro_batch_tokens=20).train_step(batch, token_mean_pg)
    # |log p| ~ 13, padded to other lengths per micro-batch: a few ulps apart
    assert abs(whole["pg/logp_mean"] - split["pg/logp_mean"]) < 1e-5  # summed shares
    assert abs(whole["pg/logp/min"] - split["pg/logp/min"]) < 1e-5  # a min, not a sum (a sum would be ~3x)
    with_ent = build().train_step(batch, EntropyBonusLoss())
    assert with_ent["entropy"] > 0 and with_ent["train/loss"] < whole["train/loss"]


def test_lr_schedule_reference_model_and_sleep(build):
    batch = make_batch()
    engine = build(lr_lambda=lambda step: 1.0 / (step + 1), ref=MegatronRefConfig())
    before = engine.forward_logprobs(batch).log_probs
    assert torch.equal(engine.forward_logprobs(batch, model="ref").log_probs, before)
    lrs = [engine.train_step(batch, token_mean_pg)["train/lr"] for _ in range(3)]
    assert lrs == pytest.approx([OPT.lr, OPT.lr / 2, OPT.lr / 3])
    assert not torch.allclose(engine.forward_logprobs(batch).log_probs, before)
    assert torch.equal(engine.forward_logprobs(batch, model="ref").log_probs, before)
    engine.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        engine.forward_logprobs(batch)
    engine.wake_up()
    with pytest.raises(ValueError, match="has no critic"):
        engine.forward_logprobs(batch, model="critic")


def test_checkpoint_round_trip_is_bit_exact(build, tmp_path):
    batches = [make_batch(seed=s) for s in range(4)]
    straight = build(lr_lambda=lambda step: 1.0 / (1 + step))
    for b in batches[:2]:
        straight.train_step(b, token_mean_pg)
    straight.save(str(tmp_path / "ckpt"))
    tail = [straight.train_step(b, token_mean_pg)["train/loss"] for b in batches[2:]]
    resumed = build(lr_lambda=lambda step: 1.0 / (1 + step))
    resumed.load(str(tmp_path / "ckpt"))
    assert resumed.step == 2
    assert [resumed.train_step(b, token_mean_pg)["train/loss"] for b in batches[2:]] == tail
    assert max_abs_diff(sync_weights(resumed), sync_weights(straight)) == 0.0
    with pytest.raises(FileNotFoundError, match="not a complete Tandem checkpoint"):
        resumed.load(str(tmp_path / "nope"))


def test_bf16_model_trains_through_fp32_master_weights(build, tmp_path):
    batch = make_batch()
    engine = build(dtype="bfloat16")
    masters = engine.optim.masters()
    params = {id(p): p for _, _, p in engine.params}
    low = {k for k, p in params.items() if p.dtype == torch.bfloat16}  # Megatron keeps its norms in fp32
    assert low and set(masters) == low and all(m.dtype == torch.float32 for m in masters.values())
    before = {k: m.clone() for k, m in masters.items()}
    for _ in range(2):
        assert engine.train_step(batch, token_mean_pg)["train/skipped_step"] == 0.0
    moved = kept_in_master = 0
    for k, m in masters.items():
        assert torch.equal(params[k], m.to(torch.bfloat16))  # the model is its master, rounded
        changed = m != before[k]
        moved += int(changed.sum())
        kept_in_master += int((changed & (params[k] == before[k].to(torch.bfloat16))).sum())
    assert moved > 0 and kept_in_master > 0  # updates below a bf16 ulp live on in the master
    assert {t.dtype for t in sync_weights(engine).values()} == {torch.bfloat16}  # fp32 norms leave as bf16
    engine.save(str(tmp_path / "ckpt"))
    resumed = build(dtype="bfloat16")
    resumed.load(str(tmp_path / "ckpt"))
    again = resumed.optim.masters()
    pairs = zip(engine.optim.params, resumed.optim.params, strict=True)
    restored = [torch.equal(masters[id(a)], again[id(b)]) for a, b in pairs if id(a) in masters]
    assert len(restored) == len(masters) and all(restored)


def test_deterministic_mode_repeats_bit_for_bit(build):
    batch = make_batch(seed=2)
    runs = []
    for _ in range(2):
        engine = build(deterministic=True)
        metrics = [engine.train_step(batch, token_mean_pg) for _ in range(2)]
        runs.append(
            (
                [m["train/loss"] for m in metrics],
                engine.forward_logprobs(batch).log_probs,
                sync_weights(engine),
            )
        )
    assert runs[0][0] == runs[1][0] and torch.equal(runs[0][1], runs[1][1])
    assert max_abs_diff(runs[0][2], runs[1][2]) == 0.0
    assert engine.policy.module.config.deterministic_mode


def test_bad_input_names_the_value_and_the_limit(build):
    engine = build(micro_batch_tokens=12)
    with pytest.raises(ValueError, match=r"row 1 has 15 tokens, more than micro_batch_tokens=12"):
        engine.forward_logprobs(make_batch())
    with pytest.raises(ValueError, match=r"more than the model context \(max_position_embeddings=1024\)"):
        engine.train_step(make_batch([(600, 500)]), token_mean_pg)
    with pytest.raises(ValueError, match="the Megatron engine trains the policy only"):
        engine.train_step(make_batch(), token_mean_pg, model="critic")
    with pytest.raises(
        ValueError, match="tensor_parallel x pipeline_parallel = 2 x 1 must divide the world size 1"
    ):
        build(parallel=MegatronParallelConfig(tensor_parallel=2))
    with pytest.raises(ValueError, match="layer_spec='transformer_engine' needs CUDA"):
        build(layer_spec="transformer_engine")
    with pytest.raises(ValueError, match=r"micro_batch_tokens=0 must be >= 1"):
        MegatronConfig(micro_batch_tokens=0)
    with pytest.raises(ValueError, match="sequence_parallel=True needs tensor_parallel > 1"):
        MegatronParallelConfig(sequence_parallel=True)
    with pytest.raises(ValueError, match="MegatronConfig.model is not set"):
        MegatronEngine(MegatronConfig())


def test_config_loads_from_a_recipe_mapping():
    from tandem.config import ConfigError, from_dict

    cfg = from_dict(
        MegatronConfig,
        {
            "model": {"name": "tiny-qwen3"},
            "parallel": {"tensor_parallel": 2, "distributed_optimizer": True},
            "optimizer": {"lr": 1e-5, "betas": [0.9, 0.95]},
            "transformer_config": {"recompute_granularity": "full"},
        },
    )
    assert cfg.parallel.tensor_parallel == 2 and cfg.optimizer.betas == (0.9, 0.95)
    with pytest.raises(ConfigError, match=r"parallel.tensor_parallel=0 must be >= 1"):
        from_dict(MegatronConfig, {"parallel": {"tensor_parallel": 0}})
    # LoRA's section (and what it refuses): test_megatron_lora.py


# -- CPU shims ---------------------------------------------------------------------------------------


def test_cpu_rng_tracker_forks_the_cpu_generator_and_resumes_each_stream(build):
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    build()  # installs the tracker with seed 0
    tracker = get_cuda_rng_tracker()
    outside = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), outside)  # the default stream is untouched
    with tracker.fork():
        b = torch.rand(3)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0 + 2718)  # Megatron's model-parallel seed for TP rank 0
        assert torch.equal(torch.rand(6), torch.cat([a, b]))  # one stream, continued across forks


def test_cpu_rotary_table_is_megatrons_formula_on_the_cpu(build):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from tandem.engines.training.megatron.cpu_shim import cpu_rotary_emb

    rope = build().policy.module.rotary_pos_emb
    emb = rope(11)
    assert emb.device.type == "cpu" and emb.shape == (11, 1, 1, 16)
    freqs = torch.outer(torch.arange(11.0), rope.inv_freq)
    assert torch.equal(emb[:, 0, 0], torch.cat([freqs, freqs], -1))
    from tandem.engines.training.megatron.cpu_shim import apply_cpu_shims

    with pytest.raises(ValueError, match="for device 'cpu' only"):
        apply_cpu_shims(torch.nn.Module(), torch.device("cuda"))
    plain = RotaryEmbedding(kv_channels=16, rotary_percent=1.0, use_cpu_initialization=True)
    assert torch.equal(cpu_rotary_emb(plain, 5)[:, 0, 0, :8], torch.outer(torch.arange(5.0), plain.inv_freq))


# -- core attention (megatron/attention.py): SDPAttention against Megatron's DotProductAttention ---------------


def _attention(forward, core, q, k, v, mask):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = forward(core, q, k, v, mask)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def test_sdpa_core_attention_equals_megatrons(build):
    """The same outputs and gradients under the causal mask, no mask (causal) and another mask, with GQA."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    engine = build("tiny-qwen3")
    core = engine.policy.module.decoder.layers[0].self_attention.core_attention
    assert type(core).__name__ == "SDPAttention"
    heads, groups = core.num_attention_heads_per_partition, core.num_query_groups_per_partition
    hn = core.hidden_size_per_attention_head
    assert heads > groups  # the tiny Qwen3 has grouped queries
    g = torch.Generator().manual_seed(0)
    s, b = 9, 2
    q = torch.randn(s, b, heads, hn, generator=g)
    k, v = (torch.randn(s, b, groups, hn, generator=g) for _ in range(2))
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]
    other = causal.clone()
    other[..., 4:, 2] = True  # rows 4.. do not see key 2
    core.train()
    for mask, their_mask in ((causal, causal), (None, causal), (other, other)):
        # no mask: causal (Megatron's own forward builds that default on CUDA only)
        ours = _attention(type(core).forward, core, q, k, v, mask)
        theirs = _attention(DotProductAttention.forward, core, q, k, v, their_mask)
        assert ours[0].shape == (s, b, heads * hn)
        for a, t in zip(ours, theirs, strict=True):
            assert (a - t).abs().max() < 1e-5, None if mask is None else mask.sum()
    assert _causal(causal, s, s) and not _causal(other, s, s) and not _causal(causal, s, s + 1)
    with pytest.raises(AssertionError, match="Packed sequence is not supported by DotProductAttention"):
        core(q, k, v, causal, packed_seq_params=object())  # what SDPA does not take goes to Megatron's forward
    core.attention_dropout.p = 0.5  # dropout while training: Megatron's forward, given the causal mask it needs
    try:
        dropped = core(q, k, v, None)
    finally:
        core.attention_dropout.p = 0.0
    plain = core(q, k, v, None)
    assert dropped.shape == plain.shape and not torch.allclose(dropped, plain)


def test_engine_with_either_attention_gives_the_same_logprobs_and_step(build):
    """`attention: megatron` (Megatron's own core attention) and the default agree, before and after a step."""
    batch = make_batch(seed=3)
    results = []
    for attention in ("sdpa", "megatron"):
        engine = build("tiny-qwen2", attention=attention)
        lp = engine.forward_logprobs(batch, with_entropy=True)
        metrics = engine.train_step(batch, token_mean_pg)
        results.append((lp, metrics, engine.forward_logprobs(batch).log_probs))
        engine.close()
    (a, ma, a2), (b, mb, b2) = results
    assert (a.log_probs - b.log_probs).abs().max() < 1e-5 and (a.entropy - b.entropy).abs().max() < 1e-5
    assert abs(ma["train/grad_norm"] - mb["train/grad_norm"]) < 1e-4 * mb["train/grad_norm"]
    assert (a2 - b2).abs().max() < 1e-5  # after the step
    with pytest.raises(ValueError, match="attention='flash': choose 'sdpa' or 'megatron'"):
        build("tiny-qwen2", attention="flash")


# -- shared prompts (pipeline.py: pad_rows) ----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-llama"])
def test_shared_prompts_give_the_log_probs_and_step_of_separate_rows(build, name):
    """A group's prompt fed once (one row: the prompt, then each response attending to it and to itself, at
    its own positions) gives the log-probs, entropy, gradients and weights of the rows fed separately."""
    batch = make_batch(GROUPED, shared_prompts=True, seed=5)
    results = []
    for share in (True, False):
        engine = build(name, share_prompts=share, micro_batch_tokens=40)
        plan = [list(range(batch.batch_size))]
        shared = [sb for _, sb in engine._stage_batches(batch, plan)]
        # sharing: 4 rows of a prompt and two responses (5 + 6 + 11 fed tokens at most); otherwise the 8 rows
        assert [tuple(sb.input_ids.shape) for sb in shared] == ([(4, 22)] if share else [(8, 16)])
        assert all(sb.rotary_at_positions == share for sb in shared)
        lp = engine.forward_logprobs(batch, with_entropy=True)
        metrics = engine.train_step(batch, token_mean_pg)
        results.append((lp, metrics, sync_weights(engine)))
        engine.close()
    (a, ma, wa), (b, mb, wb) = results
    assert (a.log_probs - b.log_probs).abs().max() < 1e-5 and (a.entropy - b.entropy).abs().max() < 1e-5
    assert a.log_probs.abs().sum() > 0
    assert abs(ma["train/grad_norm"] - mb["train/grad_norm"]) < 1e-5 * mb["train/grad_norm"]
    assert max_abs_diff(wa, wb) < 1e-6
