"""`warm_vector_math`: each Python thread's intra-op team is warmed once per thread count, before the
rotary table's first cos/sin (the race it prevents: tandem/models/vector_math.py)."""

from __future__ import annotations

import threading

import torch

from tandem.models import vector_math
from tandem.models.transformer import RotaryEmbedding, TransformerArgs


def _in_thread(fn):
    out = {}

    def run():
        out["value"] = fn()

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out["value"]


def _calls(monkeypatch) -> list[int]:
    """Count the warm-ups that run (the cos calls on a 2 x 2048 x threads buffer)."""
    seen: list[int] = []
    real_cos = torch.cos

    def cos(x, *a, **kw):
        if x.numel() == 2 * 2048 * max(torch.get_num_threads(), 1) and x.dtype == torch.float32:
            seen.append(x.numel())
        return real_cos(x, *a, **kw)

    monkeypatch.setattr(vector_math.torch, "cos", cos)
    return seen


def test_each_thread_warms_once_per_thread_count(monkeypatch):
    seen = _calls(monkeypatch)
    threads = torch.get_num_threads()

    def twice():
        vector_math.warm_vector_math()
        vector_math.warm_vector_math()
        return vector_math._warmed.threads

    assert _in_thread(twice) == threads
    assert len(seen) == 1  # the second call in that thread is a no-op
    assert _in_thread(twice) == threads
    assert len(seen) == 2  # another Python thread has its own OpenMP team: warmed again
    try:
        torch.set_num_threads(threads + 1)  # a larger team has new worker threads
        _in_thread(twice)
        assert len(seen) == 3 and seen[-1] == 2 * 2048 * (threads + 1)
    finally:
        torch.set_num_threads(threads)


def _rotary() -> RotaryEmbedding:
    from transformers import AutoConfig

    from tandem.models import resolve_model

    return RotaryEmbedding(TransformerArgs.from_hf_config(AutoConfig.from_pretrained(str(resolve_model("tiny-llama")))))


def test_the_rotary_table_warms_its_thread_on_the_cpu_only(monkeypatch):
    seen = _calls(monkeypatch)
    rope = _rotary()
    on_meta = _rotary().to("meta")

    def forward(device):
        module = on_meta if device == "meta" else rope
        cos, sin = module(torch.arange(300, device=device), torch.float32)
        return getattr(vector_math._warmed, "threads", 0), cos

    warmed, cos = _in_thread(lambda: forward("meta"))
    assert warmed == 0 and not seen and cos.device.type == "meta"
    warmed, cos = _in_thread(lambda: forward("cpu"))
    assert warmed == torch.get_num_threads() and len(seen) == 1
    # the table itself is unchanged by the warm-up: HF's formula, float32
    want = (torch.arange(300)[:, None].float() * rope.inv_freq[None, :]).repeat(1, 2).cos()
    assert torch.equal(cos, want)


def test_the_fsdp_trainer_warms_its_thread_for_hf_models_too(monkeypatch):
    """The HF fallback (``packing: false``) computes its own rotary table: the trainer warms before it."""
    from tandem.engines.training.fsdp import FSDPConfig, FSDPEngine
    from tandem.models import ModelConfig

    from ..engines.training.helpers import make_batch

    engine = FSDPEngine(FSDPConfig(model=ModelConfig(name="tiny-llama"), packing=False))
    assert not engine.native  # the HF model, not tandem.models
    seen = _calls(monkeypatch)
    batch = make_batch([(5, 3), (4, 6)], vocab=64)

    def score():
        out = engine.forward_logprobs(batch)
        return getattr(vector_math._warmed, "threads", 0), out

    warmed, out = _in_thread(score)
    assert warmed == torch.get_num_threads() and len(seen) == 1
    assert torch.isfinite(out.log_probs).all()
