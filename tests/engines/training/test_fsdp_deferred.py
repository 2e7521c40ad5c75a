"""fsdp/deferred.py in one process: a model built with its matrices on the meta device and read module by module
is the eagerly loaded model bit for bit (LoRA applied, ties kept), and what goes wrong is named. The sharded
engine that uses it is compared with one process in test_fsdp_dist.py."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tandem.engines.training.fsdp.config import LoRAConfig
from tandem.engines.training.fsdp.deferred import DeferredWeights
from tandem.engines.training.fsdp.lora import apply_lora
from tandem.engines.training.fsdp.modules import decoder_layers, load_lm
from tandem.models import ModelConfig


def _loaded(model: str, deferred: bool, lora: bool):
    loaded = load_lm(ModelConfig(name=model), packing=True, deferred=deferred)
    if lora:
        torch.manual_seed(0)
        apply_lora(loaded.lm, LoRAConfig(rank=4, target_modules=("q_proj", "down_proj")))
    return loaded


@pytest.mark.parametrize("model,lora", [("tiny-llama", False), ("tiny-qwen3", True), ("tiny-qwen3-moe", False)])
def test_reading_module_by_module_gives_the_eager_model_bit_for_bit(model, lora):
    eager = _loaded(model, deferred=False, lora=lora).lm
    loaded = _loaded(model, deferred=True, lora=lora)
    lm, later = loaded.lm, loaded.deferred
    matrices = {n for n, p in lm.named_parameters() if p.is_meta}
    assert matrices and all(p.dim() >= 2 for n, p in lm.named_parameters() if n in matrices)
    assert not any(".lora_" in n for n in matrices)  # adapters are drawn on the host, as in the eager build
    later.track(lm)
    for layer in decoder_layers(lm, True):  # as apply_fsdp calls it: each layer, then the root
        later.materialize(layer)
        assert not any(p.is_meta for p in layer.parameters())
    later.materialize(lm)
    later.check_done()
    assert later.read_bytes == sum(p.numel() * p.element_size() for n, p in lm.named_parameters(remove_duplicate=True)
                                   if n in matrices)
    got, want = dict(lm.named_parameters()), dict(eager.named_parameters())
    assert got.keys() == want.keys()
    for name, p in got.items():
        assert p.requires_grad == want[name].requires_grad and torch.equal(p, want[name]), name
    if lm.args.tie_word_embeddings:
        assert lm.lm_head.weight is lm.model.embed_tokens.weight


def test_a_weight_never_read_or_of_another_shape_is_named():
    loaded = _loaded("tiny-llama", deferred=True, lora=False)
    later = loaded.deferred
    later.track(loaded.lm)
    later.materialize(decoder_layers(loaded.lm, True)[0])
    with pytest.raises(RuntimeError, match=r"deferred weights were never read \(model\.embed_tokens\.weight"):
        later.check_done()

    class Shorter:  # the files hold a tensor of another shape than the model's
        def shape(self, name):
            return (3, 3)

    wrong = DeferredWeights("folder", Shorter())
    wrong.track(_loaded("tiny-llama", deferred=True, lora=False).lm)
    with pytest.raises(ValueError, match=r"folder: model\.embed_tokens\.weight has shape \(3, 3\) in the checkpoint"):
        wrong.materialize(_any_embedding(wrong))


def _any_embedding(later: DeferredWeights):
    owner, _ = next(iter(later._owners.values()))[0]
    return owner


def test_a_qlora_base_is_quantized_as_it_is_read_in_one_process():
    """QLoRA reads each targeted weight right before quantizing it (any world): the same quantized base, adapters
    and log-probs as quantizing the whole loaded model, without the model ever in full precision."""
    from tandem.engines.training.fsdp import FSDPConfig, FSDPEngine, ParallelConfig
    from tandem.kernels import QuantConfig

    from .helpers import make_batch

    lora = LoRAConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"),
                      quantize_base=QuantConfig(format="fp8_block", block_size=(32, 32)))
    engines = [FSDPEngine(FSDPConfig(model=ModelConfig(name="tiny-llama"), lora=lora, micro_batch_tokens=64,
                                     parallel=ParallelConfig(sharded_load=on))) for on in (True, False)]
    read, whole = engines
    assert read.deferred_bytes > 0 and whole.deferred_bytes == 0
    states = [dict(e.policy.module.state_dict()) for e in engines]
    assert states[0].keys() == states[1].keys()
    for name, t in states[0].items():
        assert t.dtype == states[1][name].dtype and torch.equal(t.view(torch.uint8) if t.dtype.itemsize == 1 else t,
                                                                states[1][name].view(torch.uint8)
                                                                if t.dtype.itemsize == 1 else states[1][name]), name
    batch = make_batch(seed=0)
    assert torch.equal(read.forward_logprobs(batch).log_probs, whole.forward_logprobs(batch).log_probs)
    for e in engines:
        e.close()


@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-llama"])
def test_the_hf_model_is_read_module_by_module_where_its_checkpoint_names_its_parameters(model):
    """The HF fallback (``packing: false``) builds on the meta device and reads its parameters by name, as
    `from_pretrained` would: the same parameters, buffers, mode and logits."""
    eager = load_lm(ModelConfig(name=model), packing=False).lm
    loaded = load_lm(ModelConfig(name=model), packing=False, deferred=True)
    assert not loaded.native and loaded.deferred is not None
    loaded.deferred.track(loaded.lm)
    for layer in decoder_layers(loaded.lm, False):
        loaded.deferred.materialize(layer)
    loaded.deferred.materialize(loaded.lm)
    loaded.deferred.check_done()
    got, want = loaded.lm.state_dict(), eager.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert loaded.lm.training == eager.training is False
    ids = torch.randint(0, 500, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded.lm(ids).logits, eager(ids).logits)


@pytest.mark.parametrize("model", ["tiny-deepseek-v3", "tiny-glm4-moe", "tiny-qwen3-moe"])
def test_an_hf_moe_whose_experts_transformers_fuses_is_read_from_the_experts_tensors(model):
    """transformers fuses a MoE's per-expert checkpoint tensors into one per projection while loading
    (fsdp/converted.py): the deferred load builds the same tensors from the experts' own, whole or by rows of
    experts, and the model is `from_pretrained`'s bit for bit."""
    from tandem.engines.training.fsdp.converted import Stacked

    eager = load_lm(ModelConfig(name=model), packing=False).lm
    loaded = load_lm(ModelConfig(name=model), packing=False, deferred=True)
    later = loaded.deferred
    assert later is not None and not loaded.native
    fused = {n: s for n, s in later.sources.items() if isinstance(s, Stacked)}
    assert fused and all(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in fused)
    gate_up = next(s for n, s in fused.items() if n.endswith("gate_up_proj"))
    assert len(gate_up.parts) == 2 and gate_up.parts[0][3].endswith("experts.3.gate_proj.weight")
    want = eager.state_dict()
    for name, source in fused.items():  # experts [2, 5) alone: what a rank reads of them
        assert torch.equal(source.read(later.index, torch.float32, (2, 5)), want[name][2:5])
    later.track(loaded.lm)
    for layer in decoder_layers(loaded.lm, False):
        later.materialize(layer)
    later.materialize(loaded.lm)
    later.check_done()
    got = loaded.lm.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    ids = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded.lm(ids).logits, eager(ids).logits)


def test_an_expert_missing_from_the_checkpoint_or_of_another_shape_loads_whole():
    from tandem.engines.training.fsdp.converted import checkpoint_sources
    from tandem.engines.training.fsdp.deferred import _parameters_on_meta
    from tandem.models import resolve_model
    from tandem.models.safetensors_read import SafetensorsIndex

    path = resolve_model("tiny-deepseek-v3")
    index = SafetensorsIndex(sorted(path.glob("*.safetensors")))
    for experts, intermediate in ((8, 32), (9, 32), (8, 16)):  # the checkpoint's; one expert too many; narrower
        config = AutoConfig.from_pretrained(str(path))
        config.n_routed_experts, config.moe_intermediate_size = experts, intermediate
        with _parameters_on_meta():
            lm = AutoModelForCausalLM.from_config(config)
        got = checkpoint_sources(lm, index)
        assert (got is not None) == ((experts, intermediate) == (8, 32)), (experts, intermediate)


def test_parameters_go_to_meta_only_for_the_thread_that_builds():
    import threading

    from tandem.engines.training.fsdp.deferred import _parameters_on_meta

    other = {}
    with _parameters_on_meta():
        mine = torch.nn.Linear(4, 3)
        t = threading.Thread(target=lambda: other.setdefault("m", torch.nn.Linear(4, 3)))
        t.start()
        t.join()
    assert mine.weight.is_meta and mine.bias.is_meta
    assert not other["m"].weight.is_meta and other["m"].weight.abs().sum() > 0  # initialised as usual
    assert not torch.nn.Linear(2, 2).weight.is_meta  # and nothing after it


@pytest.mark.dist
def test_three_ranks_read_uneven_rows_and_hold_the_whole_loads_model(tmp_path):
    """Rows split unevenly over three ranks (FSDP pads the short shards), on the native model and on an HF MoE whose
    experts transformers fuses: each rank reads its rows alone, the three read the model once between them, and
    the model is the one loaded whole and then sharded, bit for bit, before and after a step."""
    from . import fsdp_workers as workers
    from .helpers import run_workers

    run_workers(workers.uneven_load, 3, str(tmp_path))
    ranks = [torch.load(tmp_path / f"uneven_rank{r}.pt", weights_only=False) for r in range(3)]
    for model in ("tiny-llama", "tiny-deepseek-v3"):
        for r in ranks:
            for when in ("before", "after"):
                read, whole = r[model, "read"][when], r[model, "whole"][when]
                assert read.keys() == whole.keys() and all(torch.equal(read[n], whole[n]) for n in read), (model, when)
            assert r[model, "whole"]["deferred_bytes"] == 0
    got = [r["tiny-llama", "read"]["deferred_bytes"] for r in ranks]  # the native model defers its matrices
    assert got == [workers.deferred_bytes(rank, 3, vectors=False) for rank in range(3)]
    assert len(set(got)) > 1 and sum(got) == workers.deferred_bytes(0, 1, vectors=False)
    got = [r["tiny-deepseek-v3", "read"]["deferred_bytes"] for r in ranks]  # the HF model: every parameter
    assert len(set(got)) > 1 and sum(got) == ranks[0]["tiny-deepseek-v3", "read"]["params"]
