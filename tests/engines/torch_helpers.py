"""Shared helpers for the torch inference engine tests: engines on tiny models, teacher-forced passes."""

from __future__ import annotations

import copy
import time
from pathlib import Path

import torch

from tandem.core.protocols import GenerationRequest, SamplingParams
from tandem.engines.inference.torch import TorchEngine, TorchEngineConfig
from tandem.models import ModelConfig
from tandem.models.attention import MoERouting, VarlenAttention
from tandem.ops import InvariantVarlenAttention, batch_invariant_mode
from tandem.ops.linear import ONEDNN_BF16, PackedOnlyWeight


def _cpu_flag(flag: str) -> bool:
    try:
        return flag in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


# oneDNN lays bfloat16 weights out for AMX tiles on such CPUs (Sapphire Rapids and later), a layout csrc/pack.c
# does not write: there bf16 weights are packed by oneDNN's reorder and keep their plain copy
AMX_BF16 = ONEDNN_BF16 and _cpu_flag("amx_bf16")

STOP = 2  # <|im_end|> in every registry model


def make_engine(name: str = "tiny-llama", *, dtype: str = "float32", **kw) -> TorchEngine:
    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("max_model_len", 256)
    return TorchEngine(TorchEngineConfig(model=ModelConfig(name=name, dtype=dtype), **kw))


def wait_until(condition, timeout: float = 60.0) -> None:
    """Poll ``condition()`` until it is true; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(0.002)


def prompts(lengths, vocab: int = 512, seed: int = 0) -> list[list[int]]:
    """Random prompts of the given lengths, avoiding the special ids 0-2."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def chat_prompts(name: str, questions: list[str]) -> list[list[int]]:
    """Token ids of chat-formatted user questions (with the assistant generation prompt)."""
    from tandem.models import load_tokenizer

    tok = load_tokenizer(name)
    texts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in questions
    ]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def requests(prompt_list, **sampling) -> list[GenerationRequest]:
    return [GenerationRequest(prompt_token_ids=p, sampling=SamplingParams(**sampling)) for p in prompt_list]


def plain_model(engine: TorchEngine):
    """The engine's model with plain weights, for a reference forward outside the engine: the model itself, or,
    where the engine dropped the plain copies of its packed weights (the default), a copy of it loaded from
    `named_weights` (the values its packed copies hold, exactly)."""
    model = engine.model
    dropped = {n: p for n, p in model.named_parameters() if type(p) is PackedOnlyWeight}
    if not dropped:
        return model
    weights = engine.named_weights()
    # deepcopy with the dropped weights' plain values in its memo: everything else (buffers' dtypes included)
    # is copied as it is
    return copy.deepcopy(model, {id(p): torch.nn.Parameter(weights[n], requires_grad=False) for n, p in dropped.items()})


def teacher_forced(model, pairs, *, temperature: float = 1.0, invariant: bool = False, routing: bool = False):
    """Log-probs of each response under one packed forward of ``prompt + response`` rows.

    ``model``: a model, or a `TorchEngine` (its `plain_model`). ``pairs`` is a list of ``(prompt, response)``
    token lists. Returns a list of ``[R]`` float32 tensors (and, with ``routing``, the router's own top-k
    ``[P + R - 1, layers, topk]`` per row).
    """
    if isinstance(model, TorchEngine):
        model = plain_model(model)
    rows = [torch.tensor(p + r) for p, r in pairs]
    lengths = [len(r) for r in rows]
    flat = torch.cat(rows)
    positions = torch.cat([torch.arange(n) for n in lengths])
    targets = torch.cat([torch.cat([r[1:], r[:1]]) for r in rows])  # the last target of a row is unused
    ctx_cls = InvariantVarlenAttention if invariant else VarlenAttention
    rec = MoERouting(model.args.moe_layers) if routing else None
    with torch.no_grad(), batch_invariant_mode(invariant):
        lp, _ = model(
            flat, positions, ctx_cls.from_lengths(lengths), rec, targets=targets, temperature=temperature
        )
    out, routes, offset = [], [], 0
    recorded = rec.recorded() if routing else None
    for (p, _), n in zip(pairs, lengths, strict=True):
        out.append(lp[offset + len(p) - 1 : offset + n - 1])
        if routing:
            routes.append(recorded[offset : offset + n - 1].numpy())
        offset += n
    return (out, routes) if routing else out


def generate_either_way(option: str, name: str = "tiny-qwen3") -> tuple[dict, dict]:
    """Engines with ``option`` (a native-kernel setting: ``sampler``, ``pointwise``, ...) set to ``torch`` and to
    ``native``, on the same six requests at temperature 1 with seeds: ``{mode: results}, {mode: health[option]}``."""
    batch = prompts([5, 3, 9, 1, 17, 4], seed=4)
    results, health = {}, {}
    for mode in ("torch", "native"):
        engine = make_engine(name, **{option: mode})
        health[mode] = engine.health()[option]
        results[mode] = engine.generate(requests(batch, temperature=1.0, max_new_tokens=30, seed=7))
        engine.close()
    return results, health
