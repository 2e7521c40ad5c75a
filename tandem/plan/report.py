"""The plain-text table `tandem plan` prints (the JSON form is `Plan.to_json`)."""

from __future__ import annotations

from tandem.plan.planner import Plan

__all__ = ["table"]


def _row(label: str, value: str) -> str:
    return f"  {label:<26} {value}"


def _tuning(wl) -> str:
    if not wl.lora_rank:
        return "full"
    return f"QLoRA r{wl.lora_rank} ({wl.quantize_base} base)" if wl.quantize_base else f"LoRA r{wl.lora_rank}"


def table(p: Plan) -> str:
    j = p.to_json()
    hw, m, t, i = j["hardware"], j["model"], j["trainer"], j["inference"]
    lines = [f"{'FITS' if p.fits else 'DOES NOT FIT'}: {p.reason}",
             _row("model", f"{m['name']} ({m['family']}, {m['params_b']}B params, {m['active_params_b']}B active)"),
             _row("hardware", f"{hw['gpus']} x {hw['device']} ({hw['memory_gib']} GiB, {hw['hbm_gbps']} GB/s, "
                              f"{hw['bf16_tflops']} TFLOP/s, link {hw['link_gbps']} GB/s, "
                              f"inter-node {hw['internode_gbps']} GB/s)")]
    wl = p.workload
    lines.append(_row("workload", f"{wl.prompts} prompts x {wl.samples} samples, {wl.prompt_len} + {wl.response_len} "
                                  f"tokens, {_tuning(wl)}, {wl.mode}"))
    if t:
        par = f"tp {t['tp']} pp {t['pp']} cp {t['cp']} ep {t['ep']} dp {t['dp']}"
        if t["hsdp_replicate"] > 1:
            par += f" (HSDP: {t['hsdp_replicate']} replicas x {t['dp'] // t['hsdp_replicate']} shards)"
        lines.append(_row("trainer", f"{t['engine']} {par}, offload {t['offload']}, activation checkpointing "
                                     f"{t['activation_checkpointing']}, micro-batch {t['micro_batch_tokens']} tokens"))
    if i:
        lines.append(_row("inference", f"{i['engine']} tp {i['tp']} ep {i['ep']} x {i['replicas']} replicas "
                                       f"({i['gpus']} GPUs), KV {i['kv_cache_gib']} GiB/GPU -> "
                                       f"{i['max_concurrent_sequences']} concurrent sequences per replica"))
    lines.append(_row("placement", f"{j['placement']} ({j['train_gpus']} train / {j['rollout_gpus']} rollout GPUs), "
                                   f"sync {j['sync_transport']}"))
    mem = j["memory_gib_per_gpu"]
    lines.append("  memory per GPU (GiB)" + (f"          capacity {mem.get('capacity', 0):.1f} (headroom kept)"))
    for side in ("trainer", "inference"):
        items = mem.get(f"{side}_items", {})
        detail = ", ".join(f"{k} {v}" for k, v in items.items())
        lines.append(_row(f"  {side} peak {mem.get(side, 0):.1f}", detail))
    if j["step_time_s"]:
        s = j["step_time_s"]
        lines.append(_row("step time (s)", f"rollout {s['rollout']}, train {s['train']}, sync {s['sync']}, "
                                           f"total {s['total']}"))
        eff = ", ".join(f"{k} {v}" for k, v in j["assumptions"]["efficiency"].items())
        lines.append(_row("assumed efficiency", eff))
    for why in p.why:
        lines.append(_row("why", why))
    if p.min_gpus is not None:
        lines.append(_row("min GPUs", str(p.min_gpus)))
    for knob in p.knobs:
        lines.append(_row("knob", knob))
    return "\n".join(lines)
