"""Tandem's LoRA layer is peft's: same names, same initial values from the same seed, same forward and
gradients, bit for bit; and a LoRA trainer never imports peft."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

from tandem.engines.training.fsdp.config import LoRAConfig
from tandem.engines.training.fsdp.lora import LoraLinear, adapters_disabled, apply_lora
from tandem.models import resolve_model
from tandem.models.attention import VarlenAttention
from tandem.models.transformer import CausalLM

TARGETS = ("q_proj", "v_proj", "o_proj", "gate_proj", "down_proj")


def _pair(dropout: float, dtype=torch.float32):
    """The tiny Llama with Tandem's adapters and a copy with peft's, injected under the same seed."""
    from peft import LoraConfig, inject_adapter_in_model

    base = CausalLM.from_pretrained(resolve_model("tiny-llama"), dtype=dtype)
    ours, theirs = base, copy.deepcopy(base)
    torch.manual_seed(3)
    apply_lora(ours, LoRAConfig(rank=4, alpha=8.0, dropout=dropout, target_modules=TARGETS))
    torch.manual_seed(3)
    inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8.0, lora_dropout=dropout, target_modules=list(TARGETS)),
                            theirs)
    for name, p in theirs.named_parameters():
        p.requires_grad_(".lora_" in name)
    return ours, theirs


def _run(model, seed: int):
    ids = torch.randint(0, 500, (20,), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(seed)  # dropout draws
    h = model(ids, torch.arange(20), VarlenAttention.from_lengths([20]))
    loss = model.logits(h).float().logsumexp(-1).mean()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def test_same_names_and_initial_values_as_peft():
    ours, theirs = _pair(0.0)
    a, b = ours.state_dict(), theirs.state_dict()
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    assert sum(isinstance(m, LoraLinear) for m in ours.modules()) == 2 * len(TARGETS)  # 2 layers
    lora_a = [t for n, t in a.items() if "lora_A" in n]
    assert all(t.abs().sum() > 0 for t in lora_a)  # drawn, not zero: the comparison above means something


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_and_gradients_match_peft_bit_for_bit(dropout, dtype):
    ours, theirs = _pair(dropout, dtype)
    with torch.no_grad():  # lora_B starts at zero: give it values so that the adapters act
        g = torch.Generator().manual_seed(1)
        for (na, pa), (nb, pb) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
            assert na == nb
            if "lora_B" in na:
                pa.copy_(torch.randn(pa.shape, generator=g).to(dtype))
                pb.copy_(pa)
    ours.train(), theirs.train()
    la, ga = _run(ours, seed=7)
    lb, gb = _run(theirs, seed=7)
    assert torch.equal(la, lb)
    assert list(ga) == list(gb)
    for name in ga:
        assert torch.equal(ga[name], gb[name]), name
    with adapters_disabled(ours), torch.no_grad():  # the frozen base alone: the reference model
        ids = torch.arange(10)
        off = ours.logits(ours(ids, torch.arange(10), VarlenAttention.from_lengths([10])))
    plain = CausalLM.from_pretrained(resolve_model("tiny-llama"), dtype=dtype)
    with torch.no_grad():
        ref = plain.logits(plain(ids, torch.arange(10), VarlenAttention.from_lengths([10])))
    assert torch.equal(off, ref)
    assert all(p.requires_grad == (".lora_" in n) for n, p in ours.named_parameters())  # restored


def test_lora_trainer_never_imports_peft():
    resolve_model("tiny-llama")
    code = (
        "import sys\n"
        "from tandem.engines.training.fsdp import FSDPConfig, FSDPEngine\n"
        "from tandem.engines.training.fsdp.config import LoRAConfig\n"
        "from tandem.models import ModelConfig\n"
        "e = FSDPEngine(FSDPConfig(model=ModelConfig(name='tiny-llama'), lora=LoRAConfig(rank=4)))\n"
        "assert any('lora_A' in n for n, _ in e.policy.module.named_parameters())\n"
        "print(sorted(k for k in sys.modules if k.split('.')[0] in ('peft', 'transformers')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
