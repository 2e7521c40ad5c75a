"""GPU measurement of Tandem's SGLang adapter: contract checks, tokens/s vs vLLM, weight-sync s/GB, log-prob gap.

    python bench/gpu/sglang.py                       # SGLang 0.5.23 on CUDA: smollm2-135m-instruct + tiny-qwen3-moe
    python bench/gpu/sglang.py --model smollm2-random --moe-model /path/to/an/hf/moe/folder
    python bench/gpu/sglang.py --dry-run             # validates the configs and imports; no server, no CUDA
    python bench/gpu/sglang.py --device cpu --launch embedded --model tiny-llama --quick   # CPU smoke

**Nothing here has run real SGLang**: SGLang does not install on the CPU machines this project has, and
the GPU machine sometimes lent has no package registry to install it from. On CPU, with ``--launch
embedded``, the adapter launches the embedded engine serving SGLang's API (``tandem serve --api sglang``)
instead: that is a smoke test of this script's logic, **not a measurement** of SGLang.

The adapter (`SGLangEngine`) launches the servers itself (``launch: sglang`` runs ``python -m
sglang.launch_server``; ``--launch embedded`` the embedded engine), one model at a time. Four sections:

1. ``contract`` on the dense model (``--model``) and on a small MoE (``--moe-model``; the registry's
   ``tiny-qwen3-moe`` by default, pass a real one on a GPU): token ids and log-probs for ``n`` samples,
   same seed => same tokens, abort => partial tokens with finish reason ABORT, a weight update from disk
   changes the outputs and ``weight_version`` (and restoring the weights restores them), an update by
   broadcast (``weight_transport: distributed``: nccl on CUDA, gloo on CPU; a second adapter on the same
   server) gives the tokens of the same update from disk, pause / continue (``in_place``), release /
   resume memory (sleep / wake_up, then the weights re-sent, as an RL loop does), and on the MoE the
   routed experts' shape ``[prompt + response - 1, moe layers, top-k]`` (agreement with the native
   model's own routing is reported). Each check passes or fails with its reason; one failure does not
   stop the others.
2. ``throughput`` (dense): rollout tokens/s (``--prompts`` x ``--n`` samples x ``--new-tokens``, fixed
   seeds, temperature 1) through the SGLang adapter and through Tandem's vLLM adapter on the same GPU
   (skipped, with the reason, where ``vllm`` does not import), alternating ``--repeats`` runs after a
   warm-up each: medians and spread ((max - min) / median).
3. ``weight_sync`` (dense): seconds per GB of ``update_weights`` with the full model weights (on
   ``--device``, in ``--dtype``, as a trainer holds them), disk and distributed transports, medians.
4. ``logprob_gap`` (dense): rollouts through SGLang, the same tokens scored by Tandem's FSDP trainer
   (``FSDPConfig(deterministic=...)``, same device and dtype): max and mean |rollout - trainer| log-prob.
   With the embedded engine in deterministic mode this is ~0 by construction; with real SGLang it is what
   SGLang's kernels give against Tandem's.

Servers run in deterministic mode by default (SGLang: ``enable_deterministic_inference``; embedded:
``deterministic``), which also holds for the throughput figure (``--no-deterministic`` measures the
default mode). SGLang gets ``mem_fraction_static`` 0.4 and vLLM ``gpu_memory_utilization`` 0.4 so both
fit on one GPU, and ``enable_memory_saver`` for release/resume; ``--server-args JSON`` adds or overrides
server arguments. Unverified and likely on one GPU: NCCL refuses two ranks on one device ("Duplicate GPU
detected"), so the broadcast (this process on cuda:0, the server on the same GPU) may fail there; the
check then fails with NCCL's reason. With two GPUs pass ``--server-args '{"base_gpu_id": 1}'``, or try
``--group-backend gloo``. Ends with one line ``RESULT {json}``; exits 1 if any contract check failed (or
``--device cuda`` without CUDA).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
# this file is named sglang.py: with its folder on sys.path, `import sglang` (and the adapter's check for
# an installed SGLang) would find this script instead of the package
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from tandem.core.protocols import FinishReason, GenerationRequest, SamplingParams  # noqa: E402
from tandem.engines.inference.sglang import SGLangEngine, SGLangEngineConfig  # noqa: E402
from tandem.models import ModelConfig  # noqa: E402

SECTIONS = ("contract", "throughput", "weight_sync", "logprob_gap")
DENSE_CHECKS = ("logprobs_n", "seed_repro", "abort_partial", "update_disk", "update_broadcast", "pause_continue",
                "sleep_wake")
MOE_CHECKS = (*DENSE_CHECKS, "routed_experts")


# -- setup ----------------------------------------------------------------------------------------------------


def resolved(name: str) -> str:
    """``smollm2-random`` -> the random SmolLM2-shaped folder of engine_gpu.py (no hub needed); else as given."""
    from bench.gpu.engine_gpu import model_path

    return model_path(name)


def server_args(args) -> dict:
    if args.launch == "sglang":
        out = {"mem_fraction_static": 0.4, "enable_memory_saver": True,
               "enable_deterministic_inference": args.deterministic}
    else:  # the embedded engine's inference.torch keys
        out = {"device": args.device, "deterministic": args.deterministic,
               "max_num_seqs": max(16, args.prompts * args.n)}
    return {**out, **json.loads(args.server_args or "{}")}


def engine_config(args, model: str, **kw) -> SGLangEngineConfig:
    """The adapter launching one server for ``model`` (``kw``: other fields, e.g. ``urls`` for a second adapter)."""
    base = dict(model=ModelConfig(name=model, dtype=args.dtype), launch=args.launch, max_model_len=args.max_model_len,
                group_backend=args.group_backend, startup_timeout_s=args.startup_timeout_s)
    if not kw.get("urls"):
        base["server_args"] = server_args(args)
    return SGLangEngineConfig(**{**base, **kw})


def vocab_of(engine: SGLangEngine) -> int:
    return engine.info.vocab_size


def make_requests(vocab: int, lengths, *, seed: int, **sampling) -> list[GenerationRequest]:
    g = torch.Generator().manual_seed(seed)
    return [GenerationRequest(prompt_token_ids=torch.randint(3, vocab, (n,), generator=g).tolist(),
                              sampling=SamplingParams(seed=seed * 1000 + i, **sampling))
            for i, n in enumerate(lengths)]


def tokens(results) -> list[list[int]]:
    bad = [r.error for r in results if r.error]
    if bad:
        raise AssertionError(f"generation failed: {bad[0]}")
    return [c.token_ids for r in results for c in r.completions]


def checkpoint(engine: SGLangEngine, args) -> dict[str, torch.Tensor]:
    """The model folder's weights by HF name, on ``--device`` in ``--dtype`` (what a trainer sends)."""
    from safetensors.torch import load_file

    dtype = getattr(torch, args.dtype)
    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(engine.model_folder).glob("*.safetensors")):
        out.update({k: v.to(args.device, dtype if v.is_floating_point() else v.dtype)
                    for k, v in load_file(str(f)).items()})
    if not out:
        raise RuntimeError(f"no *.safetensors in {engine.model_folder}")
    return out


def noisy(weights: dict[str, torch.Tensor], scale: float = 0.2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {k: (v + scale * torch.randn(v.shape, generator=g).to(v.device, v.dtype)) if v.is_floating_point() else v
            for k, v in weights.items()}


def nbytes(weights: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in weights.values())


def wait_until(condition, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        time.sleep(0.005)


def in_background(engine: SGLangEngine, request: GenerationRequest):
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(result=engine.generate([request])[0]), daemon=True)
    thread.start()
    wait_until(lambda: engine.health()["running"] >= 1 or "result" in out)
    return thread, out


def long_request(engine: SGLangEngine, seed: int) -> GenerationRequest:
    [r] = make_requests(vocab_of(engine), [6], seed=seed, temperature=1.0,
                        max_new_tokens=engine.config.max_model_len - 6)
    return r


# -- 1. contract ------------------------------------------------------------------------------------------------


class Ctx:
    """What the checks of one model share: the launched adapter, a second one broadcasting, the weights."""

    def __init__(self, engine: SGLangEngine, args) -> None:
        self.engine, self.args = engine, args
        self.vocab = vocab_of(engine)
        self.weights = checkpoint(engine, args)
        self.broadcaster: SGLangEngine | None = None
        self.version = engine.weight_version

    def next_version(self) -> int:
        self.version += 1
        return self.version

    def sample(self, engine: SGLangEngine | None = None, *, n: int = 2, seed: int = 5):
        reqs = make_requests(self.vocab, [7, 12], seed=seed, temperature=1.0, max_new_tokens=self.args.check_tokens, n=n)
        return (engine or self.engine).generate(reqs)

    def restore(self, engine: SGLangEngine | None = None) -> None:
        (engine or self.engine).update_weights(self.weights.items(), version=self.next_version())


def check_logprobs_n(ctx: Ctx) -> str:
    n = 4
    results = ctx.sample(n=n)
    for r in results:
        assert r.error is None, r.error
        assert len(r.completions) == n, f"{len(r.completions)} completions for n={n}"
        for c in r.completions:
            assert len(c.token_ids) == ctx.args.check_tokens, f"{len(c.token_ids)} tokens, asked {ctx.args.check_tokens}"
            assert len(c.log_probs) == len(c.token_ids), "log_probs and token_ids differ in length"
            assert all(math.isfinite(x) and x <= 1e-6 for x in c.log_probs), f"bad log-probs {c.log_probs[:4]}"
            assert all(0 <= t < ctx.vocab for t in c.token_ids), "token id outside the vocabulary"
    distinct = {tuple(c.token_ids) for c in results[0].completions}
    assert len(distinct) > 1, f"the {n} samples of one prompt are all equal"
    return f"{len(results)} prompts x {n} samples"


def check_seed_repro(ctx: Ctx) -> str:
    a, b = tokens(ctx.sample(seed=11)), tokens(ctx.sample(seed=11))
    assert a == b, "the same seeds gave different tokens"
    assert tokens(ctx.sample(seed=12)) != a, "other seeds gave the same tokens"
    return "same seed, same tokens"


def check_abort_partial(ctx: Ctx) -> str:
    request = long_request(ctx.engine, seed=21)
    max_new = request.sampling.max_new_tokens
    thread, out = in_background(ctx.engine, request)
    time.sleep(ctx.args.abort_after_s)
    ctx.engine.abort(request.request_id)
    thread.join(timeout=120)
    assert "result" in out, "the aborted request did not return"
    c = out["result"].completions[0]
    assert c.finish_reason == FinishReason.ABORT, f"finish reason {c.finish_reason} (error {out['result'].error})"
    assert len(c.token_ids) < max_new and len(c.log_probs) == len(c.token_ids), f"{len(c.token_ids)} tokens"
    return f"{len(c.token_ids)} of {max_new} tokens"


def check_update_disk(ctx: Ctx) -> str:
    before = tokens(ctx.sample(seed=31))
    version = ctx.next_version()
    ctx.engine.update_weights(noisy(ctx.weights).items(), version=version)
    results = ctx.sample(seed=31)
    changed = tokens(results)
    assert ctx.engine.weight_version == version, f"weight_version {ctx.engine.weight_version}, sent {version}"
    assert all(c.weight_versions == [version] for r in results for c in r.completions), "completions' versions"
    assert changed != before, "outputs unchanged by the noisy update"
    ctx.restore()
    assert tokens(ctx.sample(seed=31)) == before, "restoring the weights did not restore the tokens"
    return "noisy update changed the tokens, restoring restored them"


def check_update_broadcast(ctx: Ctx) -> str:
    wrong = noisy(ctx.weights)
    ctx.engine.update_weights(wrong.items(), version=ctx.next_version())
    by_disk = tokens(ctx.sample(seed=41))
    ctx.restore()
    if ctx.broadcaster is None:
        ctx.broadcaster = SGLangEngine(engine_config(ctx.args, ctx.engine.config.model.name, urls=ctx.engine.urls,
                                                     weight_transport="distributed"))
    ctx.broadcaster.update_weights(wrong.items(), version=ctx.next_version())
    by_broadcast = tokens(ctx.sample(ctx.broadcaster, seed=41))
    ctx.restore(ctx.broadcaster)
    assert by_broadcast == by_disk, "broadcast and disk updates of the same weights gave different tokens"
    return f"{ctx.broadcaster.config.group_backend}: same tokens as from disk"


def check_pause_continue(ctx: Ctx) -> str:
    request = long_request(ctx.engine, seed=51)
    thread, out = in_background(ctx.engine, request)
    time.sleep(min(ctx.args.abort_after_s, 0.2))
    ctx.engine.pause_generation("in_place")
    try:
        time.sleep(0.5)
        assert "result" not in out, "the request finished while paused (or before the pause)"
    finally:
        ctx.engine.continue_generation()
    thread.join(timeout=300)
    assert "result" in out, "the request did not finish after continue"
    c = out["result"].completions[0]
    assert c.finish_reason == FinishReason.LENGTH, f"finish reason {c.finish_reason} ({out['result'].error})"
    assert len(c.token_ids) == request.sampling.max_new_tokens, f"{len(c.token_ids)} tokens"
    return "held in place, finished after continue"


def check_sleep_wake(ctx: Ctx) -> str:
    before = tokens(ctx.sample(seed=61))
    ctx.engine.sleep()
    try:
        assert ctx.engine.health()["status"] == "sleeping"
    finally:
        ctx.engine.wake_up()
    ctx.restore()  # an RL loop sends the weights after waking the engine
    assert tokens(ctx.sample(seed=61)) == before, "different tokens after release/resume + weights re-sent"
    return "released, resumed, same tokens"


def check_routed_experts(ctx: Ctx) -> str:
    from tandem.engines.inference.sglang.engine import model_facts

    _vocab, routing, _layers = model_facts(ctx.engine.model_folder)
    assert routing is not None, "not an MoE model"
    assert ctx.engine.info.routed_experts, "the server does not return routed experts"
    [r] = make_requests(ctx.vocab, [9], seed=71, temperature=0.0, max_new_tokens=6, return_routed_experts=True)
    [res] = ctx.engine.generate([r])
    assert res.error is None, res.error
    c = res.completions[0]
    want = (len(r.prompt_token_ids) + len(c.token_ids) - 1, *routing)
    got = None if c.routed_experts is None else tuple(c.routed_experts.shape)
    assert got == want, f"routed experts shape {got}, expected {want}"
    try:  # agreement with the native model's own top-k (reported, not checked: fp ties differ by kernel)
        from tandem.models.transformer import CausalLM
        from tests.engines.torch_helpers import teacher_forced

        model = CausalLM.from_pretrained(ctx.engine.model_folder, dtype=getattr(torch, ctx.args.dtype)).eval()
        _lp, [routes] = teacher_forced(model.to(ctx.args.device), [(r.prompt_token_ids, c.token_ids)], routing=True)
        agree = f", agreement with the native router {float((c.routed_experts == routes).mean()):.3f}"
    except Exception as e:  # noqa: BLE001 - a report, not a check
        agree = f", agreement not measured ({type(e).__name__}: {e})"
    return f"shape {want}{agree}"


def run_checks(ctx: Ctx, label: str, names, out: dict) -> None:
    for name in names:
        start = time.perf_counter()
        try:
            note = globals()[f"check_{name}"](ctx)
            out[f"{label}.{name}"] = {"passed": True, "note": note}
        except Exception as e:  # noqa: BLE001 - one failed check is a finding, the others still run
            out[f"{label}.{name}"] = {"passed": False, "reason": f"{type(e).__name__}: {e}"[:500]}
            traceback.print_exc()
        out[f"{label}.{name}"]["s"] = round(time.perf_counter() - start, 2)
        entry = out[f"{label}.{name}"]
        print(f"contract {label}.{name}: {'passed' if entry['passed'] else 'FAILED'} "
              f"({entry.get('note') or entry.get('reason')}) [{entry['s']} s]", flush=True)


# -- 2. throughput ----------------------------------------------------------------------------------------------


def rollout(engine, vocab: int, args, seed: int) -> tuple[float, int]:
    reqs = make_requests(vocab, [args.prompt_len] * args.prompts, seed=seed, temperature=1.0,
                         max_new_tokens=args.new_tokens, n=args.n)
    start = time.perf_counter()
    results = engine.generate(reqs)
    seconds = time.perf_counter() - start
    return seconds, sum(len(t) for t in tokens(results))


def stats(values: list[float]) -> dict:
    med = statistics.median(values)
    return {"median": round(med, 3), "spread": round((max(values) - min(values)) / med, 3) if med else None,
            "all": [round(v, 3) for v in values]}


def vllm_engine(args, model: str):
    """Tandem's vLLM adapter on the same device, or ``(None, reason)``."""
    if importlib.util.find_spec("vllm") is None:
        return None, "vllm is not installed here"
    try:
        from tandem.engines.inference.vllm import VLLMEngine, VLLMEngineConfig

        kwargs = {"gpu_memory_utilization": 0.4} if args.device == "cuda" else {}
        return VLLMEngine(VLLMEngineConfig(model=ModelConfig(name=model, dtype=args.dtype),
                                           max_model_len=args.max_model_len, engine_kwargs=kwargs)), None
    except Exception as e:  # noqa: BLE001 - reported as the reason vLLM was skipped
        return None, f"vLLM adapter failed to start: {type(e).__name__}: {e}"[:500]


def throughput_section(engine: SGLangEngine, args, model: str) -> dict:
    vocab = vocab_of(engine)
    other, skipped = vllm_engine(args, model)
    engines = {"sglang": engine, **({"vllm": other} if other is not None else {})}
    per_s: dict[str, list[float]] = {k: [] for k in engines}
    try:
        for e in engines.values():
            rollout(e, vocab, args, seed=99)  # warm-up (CUDA graphs, allocator, first launches)
        for i in range(args.repeats):
            for name, e in engines.items():
                seconds, count = rollout(e, vocab, args, seed=100 + i)
                per_s[name].append(count / seconds)
    finally:
        if other is not None:
            other.close()
    out = {"workload": f"{args.prompts} prompts x {args.n} samples x {args.new_tokens} tokens, prompt {args.prompt_len}",
           "sglang_tokens_per_s": stats(per_s["sglang"]), "vllm_skipped": skipped}
    if other is not None:
        out["vllm_tokens_per_s"] = stats(per_s["vllm"])
    for name in engines:
        print(f"throughput {name}: {out[f'{name}_tokens_per_s']['median']:.1f} tokens/s "
              f"(spread {out[f'{name}_tokens_per_s']['spread']})", flush=True)
    if skipped:
        print(f"throughput vllm: skipped ({skipped})", flush=True)
    return out


# -- 3. weight sync ---------------------------------------------------------------------------------------------


def weight_sync_section(ctx: Ctx) -> dict:
    gb = nbytes(ctx.weights) / 1e9
    out: dict = {"gb": round(gb, 4), "tensors": len(ctx.weights)}
    for transport in ("disk", "distributed"):
        try:
            out[transport] = _sync_timing(ctx, transport, gb)
        except Exception as e:  # noqa: BLE001 - the other transport is still measured
            traceback.print_exc()
            out[transport] = {"error": f"{type(e).__name__}: {e}"[:1000]}
    return out


def _sync_timing(ctx: Ctx, transport: str, gb: float) -> dict:
    if transport == "disk":
        e = ctx.engine
    else:
        if ctx.broadcaster is None:
            ctx.broadcaster = SGLangEngine(engine_config(ctx.args, ctx.engine.config.model.name,
                                                         urls=ctx.engine.urls, weight_transport="distributed"))
        e = ctx.broadcaster
    ctx.restore(e)  # warm-up (the distributed group is made on the first update)
    seconds = []
    for _ in range(ctx.args.repeats):
        if ctx.args.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        ctx.restore(e)
        seconds.append(time.perf_counter() - start)
    out = {"s": stats(seconds), "s_per_gb": round(statistics.median(seconds) / gb, 4)}
    print(f"weight_sync {transport}: {statistics.median(seconds):.3f} s for {gb:.4f} GB = {out['s_per_gb']:.3f} s/GB",
          flush=True)
    return out


# -- 4. log-prob gap --------------------------------------------------------------------------------------------


def logprob_gap_section(ctx: Ctx) -> dict:
    from tandem.core.batch import TrainBatch
    from tandem.core.sample import Sample
    from tandem.engines.training.fsdp import FSDPConfig, FSDPEngine

    args = ctx.args
    reqs = make_requests(ctx.vocab, args.gap_lengths, seed=81, temperature=1.0, max_new_tokens=args.new_tokens, n=2)
    samples = []
    for req, res in zip(reqs, ctx.engine.generate(reqs), strict=True):
        if res.error:
            raise RuntimeError(f"generation failed: {res.error}")
        for c in res.completions:
            samples.append(Sample(tokens=req.prompt_token_ids + c.token_ids, response_length=len(c.token_ids),
                                  rollout_log_probs=c.log_probs, index=len(samples)))
    batch = TrainBatch.from_samples(samples, pad_token_id=2)
    trainer = FSDPEngine(FSDPConfig(model=ModelConfig(name=ctx.engine.config.model.name, dtype=args.dtype),
                                    device=args.device, micro_batch_tokens=256, deterministic=args.deterministic))
    try:
        train = trainer.forward_logprobs(batch).log_probs
    finally:
        trainer.close()
    mask = batch.loss_mask > 0
    diff = (train.float().cpu() - batch.rollout_log_probs.float().cpu()).abs()[mask.cpu()]
    out = {"max": float(diff.max()), "mean": float(diff.mean()), "tokens": int(mask.sum()),
           "unequal_tokens": int((diff > 0).sum()), "trainer_deterministic": args.deterministic}
    print(f"logprob_gap: max |rollout - trainer| = {out['max']:.3g}, mean {out['mean']:.3g} over {out['tokens']} "
          f"tokens ({out['unequal_tokens']} unequal)", flush=True)
    return out


# -- the run ----------------------------------------------------------------------------------------------------


def run_model(label: str, model: str, args, sections: list[str], checks: dict, result: dict) -> None:
    names = MOE_CHECKS if label == "moe" else DENSE_CHECKS
    try:
        engine = SGLangEngine(engine_config(args, model))
    except Exception as e:  # noqa: BLE001 - every check of this model fails with the reason
        reason = f"the {args.launch} server for {model} did not start: {type(e).__name__}: {e}"[:1500]
        print(reason, flush=True)
        if "contract" in sections:
            for name in names:
                checks[f"{label}.{name}"] = {"passed": False, "reason": reason}
        result.setdefault("errors", {})[label] = reason
        return
    ctx = None
    try:
        ctx = Ctx(engine, args)
        print(f"{label}: {model} on {engine.urls} ({engine.info.name} {engine.info.version}, "
              f"deterministic={engine.info.deterministic})", flush=True)
        if "contract" in sections:
            run_checks(ctx, label, names, checks)
        if label != "dense":
            return
        for section, fn in (("logprob_gap", logprob_gap_section), ("weight_sync", weight_sync_section),
                            ("throughput", lambda c: throughput_section(c.engine, args, model))):
            if section in sections:
                try:
                    result[section] = fn(ctx)
                except Exception as e:  # noqa: BLE001 - the other sections still run
                    traceback.print_exc()
                    result.setdefault("errors", {})[section] = f"{type(e).__name__}: {e}"[:1000]
    finally:
        if ctx is not None and ctx.broadcaster is not None:
            ctx.broadcaster.close()
        engine.close()


def dry_run(args, sections: list[str]) -> dict:
    """Build and check every config (and the embedded recipe / SGLang command line); no server, no CUDA."""
    from tandem.engines.inference.sglang.launch import embedded_recipe, launch_command
    from tandem.engines.inference.vllm import VLLMEngineConfig
    from tandem.engines.training.fsdp import FSDPConfig, FSDPEngine  # noqa: F401

    out: dict = {"dry": True, "sections": sections, "launch": args.launch, "device": args.device}
    for model in (args.model, args.moe_model):
        for transport in ("disk", "distributed"):
            config = engine_config(args, model, weight_transport=transport)
        if args.launch == "embedded":
            with tempfile.TemporaryDirectory() as tmp:
                embedded_recipe(config, Path(tmp))
        else:
            out["sglang_command"] = " ".join(launch_command(config, Path("/nonexistent/model"), 30000,
                                                            routed_experts=model == args.moe_model))
    VLLMEngineConfig(model=ModelConfig(name=args.model, dtype=args.dtype), max_model_len=args.max_model_len)
    FSDPConfig(model=ModelConfig(name=args.model, dtype=args.dtype), device=args.device, micro_batch_tokens=256,
               deterministic=args.deterministic)
    out["checks"] = [f"dense.{n}" for n in DENSE_CHECKS] + [f"moe.{n}" for n in MOE_CHECKS]
    out["sglang_installed"] = importlib.util.find_spec("sglang") is not None
    out["vllm_installed"] = importlib.util.find_spec("vllm") is not None
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="dense model: a registry name, an HF folder, or smollm2-random (built here, no hub)")
    p.add_argument("--moe-model", default="tiny-qwen3-moe", help="small MoE: a registry name or an HF folder")
    p.add_argument("--launch", default="sglang", choices=["sglang", "embedded"],
                   help="embedded: the embedded engine serving SGLang's API (no SGLang needed)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke test of the logic")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="default bfloat16 on cuda, float32 on cpu")
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--no-deterministic", dest="deterministic", action="store_false",
                   help="servers and trainer in their default (not batch-invariant) mode")
    p.add_argument("--group-backend", default=None, choices=["nccl", "gloo"],
                   help="the broadcast group's backend (default nccl on cuda, gloo on cpu)")
    p.add_argument("--server-args", default=None, help="JSON object added to (overriding) the servers' arguments")
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument("--quick", action="store_true", help="small sizes (the CPU smoke)")
    p.add_argument("--dry-run", action="store_true", help="validate the configs; no server, no CUDA")
    args = p.parse_args()
    sections = args.sections.split(",")
    if unknown := set(sections) - set(SECTIONS):
        p.error(f"--sections: unknown {sorted(unknown)}")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.group_backend = args.group_backend or ("nccl" if args.device == "cuda" else "gloo")
    args.check_tokens, args.abort_after_s, args.gap_lengths = 16, 0.5, [5, 61, 17, 1, 33, 90, 12, 48]
    if args.quick:
        args.prompts, args.n, args.prompt_len, args.new_tokens, args.max_model_len = 4, 2, 16, 16, 512
        args.check_tokens, args.abort_after_s, args.gap_lengths = 8, 0.2, [5, 17, 1, 12]
    if args.dry_run:
        print("RESULT " + json.dumps(dry_run(args, sections)))
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        print('RESULT {"error": "no CUDA device"}')
        sys.exit(1)
    t0 = time.perf_counter()
    checks: dict = {}
    result: dict = {"model": args.model, "moe_model": args.moe_model, "dtype": args.dtype,
                    "deterministic": args.deterministic, "real_sglang": args.launch == "sglang",
                    "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                    "threads": os.environ.get("OMP_NUM_THREADS")}
    run_model("dense", resolved(args.model), args, sections, checks, result)
    if "contract" in sections:
        run_model("moe", resolved(args.moe_model), args, ["contract"], checks, result)
    tp, sync, gap = result.get("throughput", {}), result.get("weight_sync", {}), result.get("logprob_gap", {})
    sg = (tp.get("sglang_tokens_per_s") or {}).get("median")
    vl = (tp.get("vllm_tokens_per_s") or {}).get("median")
    failed = [k for k, v in checks.items() if not v["passed"]]
    summary = {
        "contract_passed": sum(v["passed"] for v in checks.values()), "contract_total": len(checks),
        "contract_failed": failed, "sglang_tokens_per_s": sg, "vllm_tokens_per_s": vl,
        "sglang_over_vllm": round(sg / vl, 3) if sg and vl else None,
        "sync_s_per_gb_disk": (sync.get("disk") or {}).get("s_per_gb"),
        "sync_s_per_gb_distributed": (sync.get("distributed") or {}).get("s_per_gb"),
        "logprob_gap_max": gap.get("max"), "logprob_gap_mean": gap.get("mean"),
        "launch": args.launch, "device": args.device,
    }
    result.update(checks=checks, wall_s=round(time.perf_counter() - t0, 1))
    print("RESULT " + json.dumps({**summary, **result}, default=str))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
