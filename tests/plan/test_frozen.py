"""The planner's JSON for a few reference inputs is frozen: a change to the model must update
tests/plan/golden_plans.json on purpose (regenerate: python -m tests.plan.test_frozen)."""

from __future__ import annotations

import json
from pathlib import Path

from tandem.plan.archs import resolve_arch
from tandem.plan.hardware import device
from tandem.plan.memory import Workload
from tandem.plan.planner import plan

GOLDEN = Path(__file__).parent / "golden_plans.json"
CASES = {
    "qwen3-8b-8xH100": ("Qwen/Qwen3-8B", "H100", 8, Workload(prompt_len=1024, response_len=4096, prompts=64, samples=8)),
    "qwen3-235b-64xH100": ("Qwen/Qwen3-235B-A22B", "H100", 64,
                           Workload(prompt_len=1024, response_len=8192, prompts=16, samples=8)),
    "llama-70b-lora-8xH200": ("meta-llama/Llama-3.1-70B-Instruct", "H200", 8,
                              Workload(prompt_len=512, response_len=2048, prompts=32, samples=8, lora_rank=16)),
    "llama-70b-qlora-fp8-1xH200": ("meta-llama/Llama-3.1-70B-Instruct", "H200", 1,
                                   Workload(prompt_len=512, response_len=1024, prompts=4, samples=4, lora_rank=16,
                                            precision="fp8", quantize_base="fp8_block")),
    "qwen2.5-72b-2xL40S-refused": ("Qwen/Qwen2.5-72B-Instruct", "L40S", 2,
                                   Workload(prompt_len=1024, response_len=4096, prompts=32, samples=8)),
    "tiny-qwen3-cpu": ("tiny-qwen3", "cpu", 1, Workload(prompt_len=128, response_len=16, prompts=2, samples=4)),
}


def _outputs() -> dict:
    out = {}
    for name, (model, gpu, gpus, wl) in CASES.items():
        dev = device(gpu, 23.0 if gpu == "cpu" else None)
        out[name] = plan(resolve_arch(model), dev, wl, gpus).to_json()
    return json.loads(json.dumps(out))


def test_plans_are_frozen():
    assert _outputs() == json.loads(GOLDEN.read_text())


if __name__ == "__main__":
    GOLDEN.write_text(json.dumps(_outputs(), indent=1, sort_keys=True) + "\n")
