"""Long responses: peak memory of one training step against the response length, up to 8k tokens.

The trainer computes log-probs over the vocabulary in chunks of ``logprob_chunk`` rows, recomputing each
chunk's logits in backward (tandem/models/logprobs.py), so a step never holds ``[tokens, vocab]`` logits.
This measures it: a random model of the tiny family's shape (hidden 64, 2 layers) but SmolLM2's vocabulary
(49,152) and a 16k context, one sequence of 16 prompt + ``R`` response tokens, one optimizer step (token-mean
policy gradient), ``R`` = 1k, 2k, 4k, 8k. Each length runs in a fresh process: after the engine is built and
a 64-token warm-up step has allocated the optimizer state, the peak resident memory the big step adds
(``ru_maxrss``) is its figure. For scale, the logits one step would materialise unchunked are
``R x 49,152 x 4`` bytes (1.6 GB at 8k), their gradient as much again.

    .venv/bin/python bench/long_response.py            # 1k .. 8k (about a minute)
    .venv/bin/python bench/long_response.py --lengths 1024,4096
    .venv/bin/python bench/long_response.py --engine megatron   # the Megatron engine (one rank, gloo)

Ends with ``RESULT {json}``: ``step_peak_mb`` per length, ``growth_ratio_8k_over_4k`` (2.0 when the growth is
linear in the length, 4.0 when quadratic), ``logits_mb`` per length (what unchunked logits would hold).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 49152


def build_model(folder: Path) -> None:
    """A random Llama of the tiny family's shape with SmolLM2's vocabulary and a 16k context."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(folder))


def _engine(name: str, folder: str, tokens: int):
    from tandem.models import ModelConfig

    if name == "megatron":
        from tandem.engines.training.megatron import MegatronConfig, MegatronEngine

        return MegatronEngine(MegatronConfig(model=ModelConfig(name=folder), micro_batch_tokens=tokens))
    from tandem.engines.training.fsdp import FSDPConfig, FSDPEngine

    return FSDPEngine(FSDPConfig(model=ModelConfig(name=folder), micro_batch_tokens=tokens))


def one_step(folder: str, response: int, engine_name: str = "fsdp") -> dict[str, float]:
    """In this (fresh) process: the peak memory one training step on a 16 + ``response`` token sequence adds."""
    import torch

    from tandem.core.batch import TrainBatch
    from tandem.core.sample import Sample

    def batch(length: int) -> TrainBatch:
        g = torch.Generator().manual_seed(length)
        tokens = torch.randint(3, VOCAB, (16 + length,), generator=g).tolist()
        b = TrainBatch.from_samples([Sample(tokens=tokens, response_length=length, loss_mask=[1] * length)],
                                    pad_token_id=2)
        b.advantages = torch.randn(b.loss_mask.shape, generator=g) * b.loss_mask
        return b

    def loss_fn(out, b, scale):
        loss = -(out.log_probs * b.advantages * b.loss_mask).sum() / scale.num_tokens
        return loss, {"pg/loss": loss.detach()}

    torch.set_num_threads(1)
    engine = _engine(engine_name, folder, 16 + response)
    engine.train_step(batch(48), loss_fn)  # optimizer state allocated
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    metrics = engine.train_step(batch(response), loss_fn)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    engine.close()
    return {"response": response, "step_peak_mb": round(peak - before, 1), "peak_rss_mb": round(peak, 1),
            "grad_norm": float(metrics.get("train/grad_norm", float("nan"))),
            "loss": float(metrics.get("pg/loss", float("nan")))}


def measure(folder: Path, response: int, engine: str = "fsdp") -> dict[str, float]:
    out = subprocess.run([sys.executable, __file__, "--child", str(folder), str(response), engine],
                         capture_output=True, text=True, timeout=900, cwd=str(ROOT))
    if out.returncode != 0:
        raise RuntimeError(f"the {response}-token step failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        sys.path.insert(0, str(ROOT))
        print(json.dumps(one_step(sys.argv[2], int(sys.argv[3]), sys.argv[4])), flush=True)
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="1024,2048,4096,8192")
    p.add_argument("--engine", choices=("fsdp", "megatron"), default="fsdp")
    args = p.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    out: dict = {"model": "random llama, hidden 64, 2 layers, vocab 49152", "engine": args.engine,
                 "step_peak_mb": {}, "logits_mb": {}}
    with tempfile.TemporaryDirectory(prefix="tandem-long-") as tmp:
        build_model(Path(tmp))
        for r in lengths:
            row = measure(Path(tmp), r, args.engine)
            out["step_peak_mb"][r] = row["step_peak_mb"]
            out["logits_mb"][r] = round(r * VOCAB * 4 / 2**20, 1)
            print(f"response {r}: the step adds {row['step_peak_mb']} MB peak (unchunked logits would be "
                  f"{out['logits_mb'][r]} MB), grad norm {row['grad_norm']:.3f}", flush=True)
    if 4096 in lengths and 8192 in lengths and out["step_peak_mb"][4096] > 0:
        out["growth_ratio_8k_over_4k"] = round(out["step_peak_mb"][8192] / out["step_peak_mb"][4096], 3)
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
