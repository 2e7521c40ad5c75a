"""Few-row products from the packed weights (csrc/skinny.c) against oneDNN's, alone and in the embedded engine.

1. Products: every linear weight of SmolLM2-135M-Instruct (30 layers x 7 + the vocabulary projection, 538 MB in
   float32, oneDNN-packed as the engine packs them) times ``M`` rows, the whole model once per timing, as a decode
   step does; oneDNN (`SKINNY_MAX_ROWS = 0`) and the kernel alternate over ``--repeats``; medians, the weights'
   read rate (GB/s) and GFLOP/s.
2. The engine: one `TorchEngine` (the default configuration; float32, or ``--dtype bfloat16``), ``--new-tokens`` sampled tokens (T = 1,
   seeded: both sides sample the same tokens up to float rounding) for batches of 1, 8 and 64 word-problem
   prompts; the two settings alternate in the same process over ``--repeats`` (after one warm-up round each);
   tokens are counted on both sides; medians and spread of tokens/s.

    python bench/skinny_linear.py             # ~5 min on 2 cores
    python bench/skinny_linear.py --repeats 1 --batches 1,8
    python bench/skinny_linear.py --dtype bfloat16   # with AVX-512 BF16

Ends with ``RESULT {json}``: ``product_speedup`` (per row count), ``decode_speedup_bs1`` / ``_bs8`` / ``_bs64``
(tokens/s with the kernel over tokens/s without).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from tandem.ops import linear  # noqa: E402

MODEL = "smollm2-135m-instruct"


def _median_spread(values: list[float]) -> tuple[float, float]:
    med = statistics.median(values)
    return med, (max(values) - min(values)) / med


def products(engine, rows: list[int], repeats: int, dtype: torch.dtype) -> dict:
    """Seconds per pass over every packed weight of ``engine`` at each row count, kernel vs oneDNN."""
    packed = engine._packed  # id(weight) -> the packed copy the engine's products read
    weights = [p for p in packed.values() if p.dtype == dtype]
    size = torch.empty(0, dtype=dtype).element_size()
    nbytes = sum(p.shape[0] * p.shape[1] * size for p in weights)
    flops_per_row = 2 * nbytes / size
    out = {}
    for m in rows:
        xs = {k: torch.randn(m, k).to(dtype) for k in {p.shape[1] for p in weights}}
        times: dict[str, list[float]] = {"onednn": [], "skinny": []}
        for rep in range(repeats + 1):
            for side, limit in (("onednn", 0), ("skinny", 64)) if rep % 2 else (("skinny", 64), ("onednn", 0)):
                linear.SKINNY_MAX_ROWS = limit
                t0 = time.perf_counter()
                with torch.inference_mode():
                    for p in weights:
                        linear._packed_product(xs[p.shape[1]], p, None)
                if rep:  # the first round warms up
                    times[side].append(time.perf_counter() - t0)
        row = {}
        for side, ts in times.items():
            med, spread = _median_spread(ts)
            row[side] = {"ms": round(med * 1e3, 2), "spread": round(spread, 3), "gb_s": round(nbytes / med / 1e9, 1),
                         "gflop_s": round(m * flops_per_row / med / 1e9, 1)}
        row["speedup"] = round(row["onednn"]["ms"] / row["skinny"]["ms"], 3)
        print(f"products, {m} rows: oneDNN {row['onednn']} / kernel {row['skinny']}: x{row['speedup']}", flush=True)
        out[m] = row
    linear.SKINNY_MAX_ROWS = 64
    return out


def decode(engine, prompts, batches: list[int], new_tokens: int, repeats: int) -> dict:
    from tandem.core.protocols import GenerationRequest, SamplingParams

    out = {}
    for bs in batches:
        runs: dict[str, list[tuple[float, int]]] = {"onednn": [], "skinny": []}
        for rep in range(repeats + 1):
            for side, limit in (("onednn", 0), ("skinny", 64)) if rep % 2 else (("skinny", 64), ("onednn", 0)):
                linear.SKINNY_MAX_ROWS = limit
                reqs = [GenerationRequest(prompt_token_ids=p, sampling=SamplingParams(
                    temperature=1.0, max_new_tokens=new_tokens, seed=1000 * rep + i)) for i, p in enumerate(prompts[:bs])]
                t0 = time.perf_counter()
                results = engine.generate(reqs)
                seconds = time.perf_counter() - t0
                if rep:
                    runs[side].append((seconds, sum(len(c.token_ids) for r in results for c in r.completions)))
        row = {}
        for side, rs in runs.items():
            med, spread = _median_spread([t / s for s, t in rs])
            row[side] = {"tokens_per_s": round(med, 2), "spread": round(spread, 3), "tokens": [t for _, t in rs]}
        row["speedup"] = round(row["skinny"]["tokens_per_s"] / row["onednn"]["tokens_per_s"], 3)
        print(f"engine, batch {bs}: oneDNN {row['onednn']} / kernel {row['skinny']}: x{row['speedup']}", flush=True)
        out[bs] = row
    linear.SKINNY_MAX_ROWS = 64
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rows", default="1,2,4,5,8,16,32,64")
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from speculative import make_prompts

    from tandem.engines.inference.torch import TorchEngine, TorchEngineConfig
    from tandem.models import ModelConfig

    batches = [int(b) for b in args.batches.split(",")]
    dtype = getattr(torch, args.dtype)
    engine = TorchEngine(TorchEngineConfig(model=ModelConfig(name=MODEL, dtype=args.dtype), max_model_len=512,
                                           max_num_seqs=max(batches)))
    if not linear._skinny_ok((576, 576), dtype):
        raise SystemExit("csrc/skinny.c cannot run here (no compiler, or oneDNN packs SmolLM2's weights otherwise)")
    prod = products(engine, [int(r) for r in args.rows.split(",")], args.repeats, dtype)
    dec = decode(engine, make_prompts(MODEL, max(batches)), batches, args.new_tokens, args.repeats)
    engine.close()
    result = {"model": MODEL, "dtype": args.dtype, "threads": args.threads, "repeats": args.repeats,
              "new_tokens": args.new_tokens, "product_speedup": {m: r["speedup"] for m, r in prod.items()},
              **{f"decode_speedup_bs{bs}": r["speedup"] for bs, r in dec.items()},
              "products": prod, "decode": dec}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
