"""GPU check of the exact true-on-policy contract on CUDA: invariant ops, bit-exact log-probs, and its cost.

    python bench/gpu/contract_gpu.py [--dtype bfloat16] [--steps 3]
    python bench/gpu/contract_gpu.py --dry-run      # builds and validates both run configs; no CUDA
    python bench/gpu/contract_gpu.py --device cpu --model tiny-llama --steps 1   # CPU smoke of the logic

On CPU the contract holds bit for bit (tests/runtime/test_contracts.py, bench/true_on_policy.py). Whether
it holds on CUDA depends on cuBLAS and the CUDA kernels behind ``tandem.ops`` keeping a row's result
independent of the row count and of the key-buffer length, which nobody has measured yet. Three
sections, on the random SmolLM2-shaped model of engine_gpu.py (shapes are what matter here):

1. ``ops``: the batch-invariant ops on CUDA tensors, fp32 and bf16: ``F.linear`` inside
   `batch_invariant_mode` on row slices (1-19, 31, 64, 129 rows at three offsets) against the full
   product; `invariant_attention` with a shorter key buffer, fewer rows, one row alone, and garbage past
   the limits, against the full call (the checks of tests/ops/test_batch_invariant.py, on CUDA).
   Counts of mismatches (0 = invariant).
2. ``logprobs``: the embedded engine (``TorchEngine(deterministic=True)``, CUDA) samples 16 sequences of
   mixed prompt lengths; the FSDP trainer (``FSDPConfig(deterministic=True)``, CUDA, a small
   micro-batch budget so rows pack differently) scores the same tokens; fp32 and bf16. The aim is a
   max |difference| of exactly 0. The same without deterministic mode shows what the mode fixes.
3. ``loop``: GRPO steps through the real loop (`tandem.runtime.loop.Run`, colocated, both engines on
   CUDA) in the ``default`` mode and the ``exact`` mode (``algorithm.contract.expect: exact``,
   deterministic engine and trainer, rollout log-probs as old log-probs, violations recorded rather
   than fatal). Median seconds per step after a warm-up step, ``exact_vs_default_step_time``
   (aim <= 1.3) and the largest train/rollout log-prob difference each mode saw (exact: 0).

``--device cpu`` runs the same code on the CPU, where the contract is known to hold: a smoke test of the
script, not a measurement. Ends with one line ``RESULT {json}``; exits 1 when the exact mode is not
bit-exact (or without CUDA).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.gpu.engine_gpu import RANDOM_MODEL, model_path, model_vocab  # noqa: E402

AIM_STEP_RATIO = 1.3
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def even_tokens(sample) -> float:
    """Reward of the loop section: fraction of even token ids in the response. A random model's tokens
    mean nothing, but this varies between samples, so GRPO has advantages to train on; it needs no
    decoding (the model's ids above 511 are outside the tiny tokenizer)."""
    ids = sample.response_tokens
    return sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1)


# -- 1. ops -------------------------------------------------------------------------------------------------


def ops_section(device: torch.device) -> dict:
    from tandem.ops import batch_invariant_mode, invariant_attention
    from tandem.ops.batch_invariant import KEY_TILE

    out: dict = {}
    for name, dtype in DTYPES.items():
        g = torch.Generator().manual_seed(0)
        weight = torch.randn(1536, 576, generator=g).to(dtype).to(device)
        x = torch.randn(300, 576, generator=g).to(dtype).to(device)
        checked = bad = 0
        with batch_invariant_mode():
            full = F.linear(x, weight)
            for rows in [*range(1, 20), 31, 64, 129]:
                for start in (0, 7, 100):
                    checked += 1
                    bad += not torch.equal(F.linear(x[start:start + rows], weight), full[start:start + rows])
        out[f"linear_{name}_mismatched"], out["linear_checked"] = bad, checked

        s, hkv, d = 3, 3, 64  # SmolLM2's 3 KV heads of 64
        keys = torch.randn(s, hkv, 4 * KEY_TILE, d, generator=g).to(dtype).to(device)
        values = torch.randn(s, hkv, 4 * KEY_TILE, d, generator=g).to(dtype).to(device)
        q = torch.randn(s, hkv, 40, d, generator=g).to(dtype).to(device)
        limits = torch.randint(1, 70, (s, 40), generator=g).to(device)
        full = invariant_attention(q, keys, values, limits, 0.125)
        dirty_k, dirty_v = keys.clone(), values.clone()
        dirty_k[:, :, 200:] += 7.0
        dirty_v[:, :, 200:] -= 3.0
        cases = {
            "shorter_buffer_fewer_rows": (invariant_attention(q[:, :, :5], keys[:, :, :128], values[:, :, :128],
                                                              limits[:, :5], 0.125), full[:, :, :5]),
            "one_row_alone": (invariant_attention(q[1:2, :, 7:8], keys[1:2, :, :128], values[1:2, :, :128],
                                                  limits[1:2, 7:8], 0.125), full[1:2, :, 7:8]),
            "garbage_past_limits": (invariant_attention(q, dirty_k, dirty_v, limits, 0.125), full),
        }
        out[f"attention_{name}_mismatched"] = [k for k, (a, b) in cases.items() if not torch.equal(a, b)]
    out["invariant"] = all(out[f"linear_{n}_mismatched"] == 0 and not out[f"attention_{n}_mismatched"]
                           for n in DTYPES)
    return out


# -- 2. engine vs trainer log-probs ------------------------------------------------------------------------


def _rollout_batch(engine, vocab: int, seed: int = 0):
    from tandem.core.batch import TrainBatch
    from tandem.core.protocols import GenerationRequest, SamplingParams
    from tandem.core.sample import Sample

    g = torch.Generator().manual_seed(seed)
    lengths = [5, 61, 17, 1, 33, 90, 12, 48]
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
    reqs = [GenerationRequest(prompt_token_ids=p, sampling=SamplingParams(temperature=1.0, max_new_tokens=40,
                                                                          seed=i, n=2))
            for i, p in enumerate(prompts)]
    samples = []
    for p, res in zip(prompts, engine.generate(reqs), strict=True):
        if res.error:
            raise RuntimeError(f"generation failed: {res.error}")
        for c in res.completions:
            samples.append(Sample(tokens=p + c.token_ids, response_length=len(c.token_ids),
                                  rollout_log_probs=c.log_probs, index=len(samples)))
    return TrainBatch.from_samples(samples, pad_token_id=2)


def logprob_section(path: str, device: str) -> dict:
    from tandem.engines.inference.torch import TorchEngine, TorchEngineConfig
    from tandem.engines.training.fsdp import FSDPConfig, FSDPEngine
    from tandem.models import ModelConfig

    out: dict = {}
    for dtype in DTYPES:
        for deterministic in (True, False):
            model = ModelConfig(name=path, dtype=dtype)
            engine = TorchEngine(TorchEngineConfig(model=model, device=device, max_num_seqs=6, max_model_len=192,
                                                   prefill_chunk=48, deterministic=deterministic))
            batch = _rollout_batch(engine, model_vocab(path))
            engine.close()
            del engine
            trainer = FSDPEngine(FSDPConfig(model=model, device=device, micro_batch_tokens=256,
                                            deterministic=deterministic))
            train = trainer.forward_logprobs(batch).log_probs
            trainer.close()
            del trainer
            mask = batch.loss_mask > 0
            diff = (train - batch.rollout_log_probs).abs()[mask]
            key = f"{dtype}_{'deterministic' if deterministic else 'default'}"
            out[f"{key}_max_abs_diff"] = float(diff.max())
            out[f"{key}_unequal_tokens"] = f"{int((diff > 0).sum())}/{int(mask.sum())}"
            print(f"log-probs {key:24s}: max |train - rollout| = {float(diff.max()):.3g}, "
                  f"unequal tokens {out[f'{key}_unequal_tokens']}", flush=True)
            _empty_cache()
    out["bit_exact"] = all(out[f"{d}_deterministic_max_abs_diff"] == 0.0 for d in DTYPES)
    return out


# -- 3. the loop: step time exact / default ----------------------------------------------------------------


def _empty_cache() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


MODES = {
    "default": {},
    "exact": {"algorithm": {"contract": {"expect": "exact", "on_violation": "warn"}},
              "trainer": {"fsdp": {"deterministic": True}}, "inference": {"torch": {"deterministic": True}}},
}


def run_config(mode: str, path: str, args):
    """The `RunConfig` of one mode (validated on creation: the dry run checks every key)."""
    from tandem.config import from_dict
    from tandem.runtime.config import RunConfig

    base = {
        "run": {"name": f"gpu-{mode}", "steps": args.steps + 1, "seed": 0, "save_every": 10_000},
        "model": {"name": path, "dtype": args.dtype},
        "data": {"source": "synthetic:arithmetic", "max_prompt_tokens": 128},
        "rollout": {"prompts_per_step": args.prompts, "n_samples_per_prompt": args.group,
                    "sampling": {"temperature": 1.0, "max_new_tokens": args.max_new_tokens}},
        "reward": {"terms": [{"name": "bench.gpu.contract_gpu:even_tokens"}]},
        "trainer": {"fsdp": {"device": args.device, "micro_batch_tokens": 8192, "optimizer": {"lr": 1e-6}}},
        "inference": {"torch": {"device": args.device, "max_num_seqs": args.prompts * args.group}},
        "tracking": {"progress": False},
    }
    return from_dict(RunConfig, _merge(base, MODES[mode]))


def loop_section(path: str, args) -> dict:
    from tandem.runtime.loop import Run
    from tandem.runtime.tracking import read_metrics

    out: dict = {}
    med = {}
    work = tempfile.mkdtemp(prefix="tandem-gpu-contract-")
    for mode in MODES:
        run_dir = Path(work) / mode
        Run(run_config(mode, path, args), run_dir).train()
        rows = read_metrics(run_dir)[1:]  # the first step warms up (cuBLAS, allocator, first launches)
        med[mode] = statistics.median(r["time/step_s"] for r in rows)
        diff = max(r["train_rollout_logprob_abs_diff/max"] for r in rows)
        out[f"{mode}_s_per_step"] = round(med[mode], 4)
        out[f"{mode}_step_s"] = [round(r["time/step_s"], 4) for r in rows]
        out[f"{mode}_train_rollout_abs_diff_max"] = diff
        print(f"loop {mode:8s}: {med[mode]:.3f} s/step, max |train - rollout| log-prob = {diff:.3g}", flush=True)
        _empty_cache()
    out["exact_vs_default_step_time"] = round(med["exact"] / med["default"], 3)
    out["loop_bit_exact"] = out["exact_train_rollout_abs_diff_max"] == 0.0
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=RANDOM_MODEL, help=f"{RANDOM_MODEL} (built here), a registry name or a folder")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES), help="the loop section's dtype")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--steps", type=int, default=3, help="timed loop steps (after one warm-up step)")
    p.add_argument("--sections", default="ops,logprobs,loop")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke test of the logic")
    p.add_argument("--dry-run", action="store_true", help="build and validate the run configs; no CUDA")
    args = p.parse_args()
    sections = args.sections.split(",")
    if unknown := set(sections) - {"ops", "logprobs", "loop"}:
        p.error(f"--sections: unknown {sorted(unknown)}")
    if args.dry_run:
        from tandem.engines.inference.torch import TorchEngine  # noqa: F401
        from tandem.engines.training.fsdp import FSDPEngine  # noqa: F401
        from tandem.ops import batch_invariant_mode, invariant_attention  # noqa: F401
        from tandem.runtime.loop import Run  # noqa: F401

        configs = {mode: run_config(mode, "/nonexistent/smollm2-random", args) for mode in MODES}
        print("RESULT " + json.dumps({"dry": True, "sections": sections, "modes": list(configs),
                                      "exact_contract": configs["exact"].algorithm.contract.expect}))
        return
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print('RESULT {"error": "no CUDA device"}')
        sys.exit(1)
    t0 = time.perf_counter()
    result: dict = {"model": args.model, "dtype": args.dtype,
                    "device": torch.cuda.get_device_name() if cuda else "cpu"}
    if "ops" in sections:
        result["ops"] = ops_section(torch.device(args.device))
        print(f"ops: invariant on {args.device} = {result['ops']['invariant']}", flush=True)
    path = model_path(args.model)
    if "logprobs" in sections:
        result["logprobs"] = logprob_section(path, args.device)
    if "loop" in sections:
        result["loop"] = loop_section(path, args)
        result["exact_vs_default_step_time"] = result["loop"]["exact_vs_default_step_time"]
        result["exact_vs_default_aim"] = AIM_STEP_RATIO
    exact = [result[s][k] for s, k in (("logprobs", "bit_exact"), ("loop", "loop_bit_exact")) if s in result]
    result["bit_exact"] = all(exact) if exact else None
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    print("RESULT " + json.dumps(result))
    sys.exit(0 if result["bit_exact"] is not False else 1)


if __name__ == "__main__":
    main()
