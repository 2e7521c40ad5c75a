"""Build planner inputs from a row of tests/plan/published.py."""

from __future__ import annotations

from tandem.plan.archs import resolve_arch
from tandem.plan.hardware import device
from tandem.plan.memory import InferenceLayout, TrainerLayout, Workload
from tandem.plan.planner import check, plan


def inputs(row: dict):
    arch, dev = resolve_arch(row["model"]), device(row["gpu"])
    wl = Workload(prompt_len=row["prompt_len"], response_len=row["response_len"], prompts=row["prompts"],
                  samples=row["samples"], precision=row.get("precision", "bf16"), ref=row.get("ref", False))
    return arch, dev, wl


def check_row(row: dict):
    arch, dev, wl = inputs(row)
    gpus = row["gpus"]
    tg = row.get("train_gpus", gpus) if row["placement"] == "disaggregated" else gpus
    rg = gpus - tg if row["placement"] == "disaggregated" else gpus
    trainer = TrainerLayout(engine=row["trainer"], gpus=tg, tp=row["tp"], pp=row["pp"], cp=row["cp"], ep=row["ep"],
                            offload=row["offload"], activation_checkpointing=row["ckpt"], micro_batch_tokens=row["mbt"])
    itp = row["inference_tp"]
    inference = InferenceLayout(engine=row["inference"], tp=itp, ep=itp if arch.moe else 1, replicas=max(1, rg // itp),
                                mem_fraction=row["mem_fraction"], max_num_seqs=wl.sequences)
    return check(arch, dev, wl, gpus, trainer, inference, row["placement"], tg)


def plan_row(row: dict):
    arch, dev, wl = inputs(row)
    return plan(arch, dev, wl, row["gpus"])
