"""The search: pick the trainer layout, the rollout engine layout and the placement that fit and step fastest
(`plan`), or judge a given layout (`check`). Pure arithmetic on `memory` and `timing`; no engine is imported.

Choices and their reasons:

* trainer: FSDP2 for dense models and small MoEs (no model parallelism to tune; Tandem's native model
  packs sequences); Megatron when an MoE has >= 20B parameters (expert parallelism) or when FSDP needs more
  than its memory allows without offload. LoRA: FSDP first, then Megatron for a dense model (megatron/lora.py:
  its adapters on a bf16 base split by TP x PP, no sequence parallelism); QLoRA and a MoE's LoRA on FSDP only
  (Tandem's Megatron engine refuses a quantized base and adapters on experts).
  Within an engine the smallest model-parallel size that fits wins (more data parallelism, less
  communication); offload and CPU optimizers come last.
* rollout: the embedded engine on a CPU; vLLM on GPUs (SGLang is judged in `check`, not chosen). TP is the smallest that leaves KV room for `MIN_CONCURRENCY` sequences (or all of a
  replica's share); MoE replicas use expert parallelism across their TP group.
* placement: colocated (the sides sleep in turn, so each has the whole GPU) when it fits; disaggregated
  splits are searched and chosen when they step faster (one-step-off / fully async overlap rollout and
  training) or when colocated does not fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from tandem.plan.archs import Arch
from tandem.plan.hardware import GIB, Device
from tandem.plan.memory import (
    GPU_ASLEEP_RESIDUAL,
    InferenceLayout,
    TrainerLayout,
    Workload,
    host_bytes,
    inference_memory,
    load_host_bytes,
    megatron_sequence_parallel,
    trainer_memory,
)
from tandem.plan.timing import EFFICIENCY, rollout_time, sync_time, train_time

__all__ = ["HEADROOM", "Plan", "check", "megatron_lora_refusals", "plan"]

HEADROOM = 0.08  # of GPU memory kept free (allocator fragmentation, spikes)
MIN_CONCURRENCY = 32
MOE_MEGATRON_PARAMS = 20e9
MICRO_BATCH_TOKENS = {"gpu": (16384, 8192, 4096), "cpu": (2048, 1024, 512)}


@dataclass(kw_only=True)
class Plan:
    fits: bool
    reason: str
    arch: Arch
    device: Device
    workload: Workload
    gpus: int
    trainer: TrainerLayout | None = None
    inference: InferenceLayout | None = None
    placement: str = "colocated"
    train_gpus: int = 0
    rollout_gpus: int = 0
    trainer_items: dict[str, float] = field(default_factory=dict)
    inference_items: dict[str, float] = field(default_factory=dict)
    memory_gib: dict[str, float] = field(default_factory=dict)
    times: dict[str, float] = field(default_factory=dict)
    concurrency: int = 0
    why: list[str] = field(default_factory=list)
    knobs: list[str] = field(default_factory=list)
    min_gpus: int | None = None

    def to_json(self) -> dict:
        t, i = self.trainer, self.inference
        gib = {k: round(v / GIB, 2) for k, v in self.trainer_items.items()}
        igib = {k: round(v / GIB, 2) for k, v in self.inference_items.items()}
        return {
            "fits": self.fits, "reason": self.reason,
            "model": {"name": self.arch.name, "family": self.arch.family,
                      "params_b": round(self.arch.total_params() / 1e9, 3),
                      "active_params_b": round(self.arch.active_params() / 1e9, 3)},
            "hardware": {"device": self.device.name, "gpus": self.gpus, "memory_gib": self.device.memory_gib,
                         "hbm_gbps": self.device.hbm_gbps, "bf16_tflops": self.device.bf16_tflops,
                         "link_gbps": self.device.link_gbps, "internode_gbps": self.device.internode_gbps,
                         "gpus_per_node": self.device.gpus_per_node},
            "trainer": None if t is None else {
                "engine": t.engine, "tp": t.tp, "pp": t.pp, "cp": t.cp, "ep": t.ep, "etp": t.etp, "dp": t.dp,
                "offload": t.offload, "activation_checkpointing": t.activation_checkpointing,
                "micro_batch_tokens": t.micro_batch_tokens,
                "sequence_parallel": megatron_sequence_parallel(self.workload, t),
                "hsdp_replicate": t.replicate, "lora_rank": self.workload.lora_rank,
                "quantize_base": self.workload.quantize_base or None},
            "inference": None if i is None else {
                "engine": i.engine, "tp": i.tp, "ep": i.ep, "replicas": i.replicas, "gpus": i.gpus,
                "mem_fraction": round(i.mem_fraction, 3), "max_concurrent_sequences": self.concurrency,
                "kv_cache_gib": igib.get("kv_cache", 0.0)},
            "placement": self.placement, "sync_transport": _transport(self),
            "train_gpus": self.train_gpus, "rollout_gpus": self.rollout_gpus,
            "memory_gib_per_gpu": {**{k: round(v, 2) for k, v in self.memory_gib.items()},
                                   "trainer_items": gib, "inference_items": igib},
            "step_time_s": {k: round(v, 3) for k, v in self.times.items()},
            "assumptions": {"efficiency": EFFICIENCY["cpu" if self.device.is_cpu else "gpu"], "headroom": HEADROOM},
            "why": self.why, "knobs": self.knobs, "min_gpus": self.min_gpus,
        }


def _transport(p: Plan) -> str:
    """What the written recipe syncs with: in-process in one process, else the Ray object store."""
    return "inprocess" if p.placement == "colocated" and p.gpus == 1 else "ray"


def _capacity(dev: Device, procs: int) -> float:
    if dev.is_cpu:
        return (dev.memory_gib - 1.0) * GIB / procs  # the OS keeps ~1 GiB; processes share the RAM
    return dev.memory_gib * GIB * (1 - HEADROOM)


def _total(items: dict[str, float]) -> float:
    return sum(items.values())


def _static(items: dict[str, float]) -> float:
    return sum(v for k, v in items.items() if k not in ("activations", "logprob_buffers"))


def _engine_asleep(iitems: dict[str, float], wl: Workload, gpus: int) -> float:
    """What an embedded engine on a CPU holds while the trainer in its process steps. A LoRA run in one process
    (the adapter-only sync the planner's recipes write; QLoRA too) keeps one base: the engine holds the trainer's frozen
    tensors (`tandem.sync.inprocess.share_frozen_base`; its ``weights`` item becomes 0) and, asleep, frees
    the packed copies it rebuilds from them at wake-up. A recipe that does not share (merged sync, separate
    placement, ``share_frozen_base: false``; `Workload.shared_base`) keeps the engine's own copy."""
    if wl.lora_rank and wl.shared_base and gpus == 1:
        iitems["weights"] = 0.0
        return _static(iitems) - iitems.get("packed_weights", 0.0)
    return _static(iitems)


def _cpu_colocated(titems: dict[str, float], iitems: dict[str, float], wl: Workload, gpus: int) -> tuple[float, float]:
    """(training-phase, rollout-phase) peak of a CPU process holding a trainer rank and its embedded engine."""
    return _total(titems) + _engine_asleep(iitems, wl, gpus), _static(titems) + _total(iitems)


def _pow2_upto(n: int) -> list[int]:
    return [1 << k for k in range(0, int(math.log2(max(1, n))) + 1)]


def _micro_batches(dev: Device, wl: Workload) -> list[int]:
    """Token budgets of a micro-batch, largest first; at least one sequence (a longer row is refused)."""
    sizes = [m for m in MICRO_BATCH_TOKENS["cpu" if dev.is_cpu else "gpu"] if m >= wl.seq_len]
    return list(dict.fromkeys([*sizes, -(-wl.seq_len // 512) * 512]))


def _fsdp_candidates(dev: Device, gpus: int, wl: Workload, offload: bool):
    # HSDP first past one node: sharded within a node, replicated across nodes (no inter-node all-gathers)
    multi_node = not dev.is_cpu and gpus > dev.gpus_per_node and gpus % dev.gpus_per_node == 0
    nodes = gpus // dev.gpus_per_node if multi_node else 1
    for replicate in dict.fromkeys((nodes, 1)):
        for ckpt in (False, True):
            for mbt in _micro_batches(dev, wl):
                yield TrainerLayout(engine="fsdp", gpus=gpus, offload=offload, activation_checkpointing=ckpt,
                                    micro_batch_tokens=mbt, replicate=replicate)


def _megatron_candidates(arch: Arch, dev: Device, gpus: int, wl: Workload, offload: bool):
    out = []
    eps = [e for e in _pow2_upto(min(arch.experts, gpus)) if arch.experts % e == 0] if arch.moe else [1]
    for tp in _pow2_upto(min(dev.gpus_per_node, gpus)):
        if arch.heads % tp:
            continue
        for pp in _pow2_upto(min(16, arch.layers, gpus // tp)):
            if gpus % (tp * pp):
                continue
            for ep in eps:
                if (gpus // pp) % ep:
                    continue
                for ckpt in (False, True):
                    out.append(TrainerLayout(engine="megatron", gpus=gpus, tp=tp, pp=pp, ep=ep, offload=offload,
                                             activation_checkpointing=ckpt, micro_batch_tokens=max(wl.seq_len, 8192),
                                             sequence_parallel=not wl.lora_rank))
    out.sort(key=lambda t: (t.tp * t.pp, t.pp, -t.ep, t.activation_checkpointing))
    for t in out:
        for mbt in _micro_batches(dev, wl):
            yield replace(t, micro_batch_tokens=mbt)


def _trainer_order(arch: Arch, dev: Device, gpus: int, wl: Workload):
    fsdp_first = not (arch.moe and arch.total_params() >= MOE_MEGATRON_PARAMS)
    if wl.lora_rank:
        groups = [("fsdp", False), ("megatron", False), ("fsdp", True), ("megatron", True)]
        if megatron_lora_refusals(arch, wl):
            groups = [g for g in groups if g[0] == "fsdp"]
    elif fsdp_first:
        groups = [("fsdp", False), ("megatron", False), ("fsdp", True), ("megatron", True)]
    else:
        groups = [("megatron", False), ("megatron", True), ("fsdp", False), ("fsdp", True)]
    for engine, offload in groups:
        if offload and dev.is_cpu:
            continue
        if engine == "fsdp":
            yield from _fsdp_candidates(dev, gpus, wl, offload)
        elif not dev.is_cpu:  # Megatron on CPU exists for tests; the planner keeps CPU plans on FSDP
            yield from _megatron_candidates(arch, dev, gpus, wl, offload)


def megatron_lora_refusals(arch: Arch, wl: Workload, sequence_parallel: bool = False) -> list[str]:
    """What Tandem's Megatron engine refuses of this LoRA workload (`megatron.lora.check_lora`); [] without LoRA."""
    if not wl.lora_rank:
        return []
    found = {"a quantized base (QLoRA trains on FSDP)": bool(wl.quantize_base),
             "adapters on a MoE's experts (FSDP trains them)": arch.moe,
             f"{arch.family}, which its native model (what it builds) does not implement": not arch.native,
             "sequence parallelism with LoRA": sequence_parallel}
    return [what for what, hit in found.items() if hit]


def _choose_trainer(arch, dev, gpus, wl, budget) -> tuple[TrainerLayout | None, dict[str, float]]:
    """The first layout in `_trainer_order` that fits; in a group of offloaded layouts of one engine (each paying
    host copies per micro-batch, fewer with larger micro-batches) the fastest that fits."""
    best, offloaded = None, []
    for lay in _trainer_order(arch, dev, gpus, wl):
        if offloaded and (lay.engine, lay.offload) != (offloaded[0][1].engine, True):
            break  # the group that fitted is done
        items = trainer_memory(arch, dev, wl, lay)
        if _total(items) <= budget and _host_ok(arch, dev, wl, lay):
            if not lay.offload:
                return lay, items
            offloaded.append((train_time(arch, dev, wl, lay, gpus), lay, items))
        if best is None or _total(items) < _total(best[1]):
            best = (lay, items)
    if offloaded:
        _, lay, items = min(offloaded, key=lambda c: c[0])
        return lay, items
    return None, best[1] if best else {}


def _host_need(arch, dev, wl, lay) -> tuple[float, float]:
    """(offloaded state, building the model) bytes of host memory per node: its ranks at once."""
    per_node = min(lay.gpus, dev.gpus_per_node)
    return host_bytes(arch, dev, wl, lay) * per_node, load_host_bytes(arch, dev, wl, lay) * per_node


def _host_ok(arch, dev, wl, lay) -> bool:
    return max(_host_need(arch, dev, wl, lay)) <= dev.host_memory_gib * GIB


def _engine_for(dev: Device) -> str:
    return "torch" if dev.is_cpu else "vllm"


def _choose_inference(arch, dev, wl, gpus: int, mem_fraction: float, engine: str | None = None):
    engine = engine or _engine_for(dev)
    if engine == "torch":
        inf = InferenceLayout(engine="torch", tp=1, replicas=gpus, mem_fraction=mem_fraction,
                              max_num_seqs=math.ceil(wl.sequences / gpus))
        return inf, inference_memory(arch, dev, wl, inf)
    best = None
    for tp in _pow2_upto(gpus):
        if gpus % tp or (arch.heads % tp and tp <= dev.gpus_per_node):
            continue
        inf = InferenceLayout(engine=engine, tp=tp, ep=tp if arch.moe and tp > 1 else 1, replicas=gpus // tp,
                              mem_fraction=mem_fraction)
        _, conc = rollout_time(arch, dev, wl, inf)
        items = inference_memory(arch, dev, wl, inf)
        if items["kv_cache"] <= 0:
            continue
        want = min(MIN_CONCURRENCY, math.ceil(wl.sequences / inf.replicas))
        if conc >= want:
            return inf, items
        if best is None or conc > best[2]:
            best = (inf, items, conc)
    return (best[0], best[1]) if best else (None, {})


def _times(arch, dev, wl, lay, inf, placement, tg, rg) -> tuple[dict[str, float], int]:
    roll, conc = rollout_time(arch, dev, wl, inf)
    tr = train_time(arch, dev, wl, lay, tg)
    sy = sync_time(arch, dev, placement, tg, rg)
    overlap = placement == "disaggregated" and wl.mode != "sync"
    total = (max(roll, tr) if overlap else roll + tr) + sy
    return {"rollout": roll, "train": tr, "sync": sy, "total": total}, conc


def _colocated(arch, dev, wl, gpus) -> Plan | None:
    cap = _capacity(dev, gpus if dev.is_cpu else 1)
    if dev.is_cpu:  # one process holds the trainer rank and its embedded engine at once
        inf, iitems = _choose_inference(arch, dev, wl, gpus, 1.0)
        lay, titems = _choose_trainer(arch, dev, gpus, wl, cap - _engine_asleep(iitems, wl, gpus))
        peak_t, peak_i = _cpu_colocated(titems, iitems, wl, gpus)
    else:
        frac = (cap - GPU_ASLEEP_RESIDUAL) / (dev.memory_gib * GIB)
        inf, iitems = _choose_inference(arch, dev, wl, gpus, frac)
        resident = iitems.get("weights", 0.0) if inf and inf.engine == "torch" else GPU_ASLEEP_RESIDUAL
        lay, titems = _choose_trainer(arch, dev, gpus, wl, cap - resident)
        peak_t = _total(titems) + resident
        peak_i = _total(iitems) + GPU_ASLEEP_RESIDUAL
    p = Plan(fits=False, reason="", arch=arch, device=dev, workload=wl, gpus=gpus, trainer=lay, inference=inf,
             placement="colocated", train_gpus=gpus, rollout_gpus=gpus, trainer_items=titems, inference_items=iitems,
             memory_gib={"trainer": peak_t / GIB, "inference": peak_i / GIB, "capacity": cap / GIB})
    if lay is None or inf is None:
        return p
    p.times, p.concurrency = _times(arch, dev, wl, lay, inf, "colocated", gpus, gpus)
    p.fits = max(peak_t, peak_i) <= cap
    return p


def _disaggregated(arch, dev, wl, gpus) -> Plan | None:
    if dev.is_cpu or gpus < 2:
        return None
    cap = _capacity(dev, 1)
    splits = range(1, gpus) if gpus <= 64 else range(8, gpus, 8)
    best = None
    for rg in splits:
        tg = gpus - rg
        inf, iitems = _choose_inference(arch, dev, wl, rg, 1 - HEADROOM)
        if inf is None:
            continue
        lay, titems = _choose_trainer(arch, dev, tg, wl, cap)
        if lay is None:
            continue
        times, conc = _times(arch, dev, wl, lay, inf, "disaggregated", tg, rg)
        if best is None or times["total"] < best.times["total"]:
            best = Plan(fits=True, reason="", arch=arch, device=dev, workload=wl, gpus=gpus, trainer=lay,
                        inference=inf, placement="disaggregated", train_gpus=tg, rollout_gpus=rg,
                        trainer_items=titems, inference_items=iitems, times=times, concurrency=conc,
                        memory_gib={"trainer": _total(titems) / GIB, "inference": _total(iitems) / GIB,
                                    "capacity": cap / GIB})
    return best


def _explain(p: Plan) -> None:
    t, i, a = p.trainer, p.inference, p.arch
    if t.engine == "fsdp":
        p.why.append("trainer fsdp: " + ((
                     f"QLoRA fits without model parallelism: the frozen base's linear weights in "
                     f"{p.workload.quantize_base} on every rank, the rest sharded" if p.workload.quantize_base else
                     "LoRA fits without model parallelism: the frozen base sharded, only the adapters trained")
                     if p.workload.lora_rank else
                     "the sharded state fits without model parallelism" if not t.offload else
                     "fits only with the sharded state offloaded to host memory"))
        if t.replicate > 1:
            p.why.append(f"HSDP: sharded within a node, replicated over {t.replicate} nodes (no inter-node all-gathers)")
    else:
        because = (f"an MoE of {a.total_params() / 1e9:.0f}B parameters needs expert parallelism" if a.moe
                   else "FSDP does not fit without offload")
        p.why.append(f"trainer megatron: {because}; tp={t.tp} pp={t.pp} ep={t.ep} is the smallest model-parallel "
                     "layout that fits")
        if p.workload.lora_rank:
            p.why.append("LoRA on Megatron: adapters on the local layer spec, no sequence parallelism "
                         "(megatron/lora.py), the base frozen in bf16")
    if t.activation_checkpointing:
        p.why.append("activation checkpointing: activations of a micro-batch do not fit otherwise")
    p.why.append(f"inference {i.engine}: " + ("the embedded engine (CPU)" if i.engine == "torch" else
                 f"tp={i.tp} is the smallest that leaves KV room for {p.concurrency} concurrent sequences"))
    p.why.append("placement " + p.placement + (": both sides get the whole GPU in turn (sleep/wake)"
                 if p.placement == "colocated" else f": {p.train_gpus} train / {p.rollout_gpus} rollout GPUs "
                 f"balance rollout {p.times['rollout']:.1f}s against train {p.times['train']:.1f}s"))


def _refusal(arch, dev, wl, gpus, colo: Plan | None) -> str:
    cap = _capacity(dev, gpus if dev.is_cpu else 1) / GIB
    if colo is not None and colo.inference is None:
        return (f"the rollout weights ({arch.total_params() / 1e9:.0f}B parameters) leave no KV cache on "
                f"{gpus} x {dev.name} ({cap:.1f} GiB usable each)")
    need = colo.memory_gib["trainer"] if colo else 0.0
    return (f"the trainer needs {need:.1f} GiB per {'process' if dev.is_cpu else 'GPU'} at best "
            f"({_items_text(colo.trainer_items)}) > {cap:.1f} GiB usable on {gpus} x {dev.name}")


def _items_text(items: dict[str, float]) -> str:
    return ", ".join(f"{k} {v / GIB:.1f}" for k, v in items.items() if v >= 0.05 * GIB)


def plan(arch: Arch, dev: Device, wl: Workload, gpus: int, *, search_min: bool = True) -> Plan:
    """The fastest layout that fits ``gpus`` devices, or a refusal with the reason and the knobs."""
    if gpus < 1:
        raise ValueError(f"--gpus {gpus} must be >= 1")
    cands = [p for p in (_colocated(arch, dev, wl, gpus), _disaggregated(arch, dev, wl, gpus)) if p is not None]
    fitting = [p for p in cands if p.fits]
    if fitting:
        best = min(fitting, key=lambda p: (p.times["total"], p.placement != "colocated"))
        best.reason = f"fits: {best.trainer.engine} + {best.inference.engine}, {best.placement}"
        _explain(best)
        if search_min:
            best.min_gpus = _min_gpus(arch, dev, wl, gpus, below=True)
        return best
    p = cands[0]
    p.fits = False
    p.reason = "does not fit: " + _refusal(arch, dev, wl, gpus, p)
    if search_min:
        p.min_gpus = _min_gpus(arch, dev, wl, gpus, below=False)
        p.knobs = _knobs(arch, dev, wl, gpus, p.min_gpus)
    return p


def _min_gpus(arch, dev, wl, gpus, *, below: bool) -> int | None:
    counts = [n for n in _pow2_upto(gpus) if n < gpus] if below else [gpus * (1 << k) for k in range(1, 12)]
    if dev.is_cpu:
        counts = [n for n in counts if n <= 8]
    for n in counts:
        if plan(arch, dev, wl, n, search_min=False).fits:
            return n
    return gpus if below else None


def _knobs(arch, dev, wl, gpus, min_gpus) -> list[str]:
    knobs = []
    if min_gpus:
        knobs.append(f"--gpus {min_gpus} (fits on {min_gpus} x {dev.name})")
    if not wl.lora_rank and plan(arch, dev, replace(wl, lora_rank=16), gpus, search_min=False).fits:
        knobs.append("--lora 16 (LoRA keeps the base frozen and sharded)")
    elif wl.lora_rank and not wl.quantize_base and plan(arch, dev, replace(wl, quantize_base="fp8_block"), gpus,
                                                        search_min=False).fits:
        knobs.append("--quantize-base fp8_block (QLoRA: the frozen base's linear weights in FP8)")
    for r in (wl.response_len // 2, wl.response_len // 4):
        if r >= 1 and plan(arch, dev, replace(wl, response_len=r), gpus, search_min=False).fits:
            knobs.append(f"--response-len {r}")
            break
    if wl.precision == "bf16" and not dev.is_cpu and plan(arch, dev, replace(wl, precision="fp8"), gpus,
                                                           search_min=False).fits:
        knobs.append("--precision fp8 (rollout weights in FP8)")
    return knobs or ["none of --lora 16 (and --quantize-base fp8_block), a shorter response or FP8 rollouts fits: "
                     "add GPUs"]


def check(arch: Arch, dev: Device, wl: Workload, gpus: int, trainer: TrainerLayout, inference: InferenceLayout,
          placement: str, train_gpus: int | None = None) -> Plan:
    """Whether a given layout fits, with each violated limit named."""
    cap = _capacity(dev, gpus if dev.is_cpu else 1)
    problems = []
    if placement == "colocated":
        tg = rg = gpus
    else:
        tg = train_gpus if train_gpus is not None else gpus - inference.gpus
        rg = gpus - tg
    if inference.gpus > rg:
        problems.append(f"inference needs {inference.gpus} GPUs (tp {inference.tp} x {inference.replicas} replicas) "
                        f"> {rg} available")
    if trainer.gpus != tg:
        trainer = replace(trainer, gpus=tg)
    if trainer.engine == "megatron":
        refused = megatron_lora_refusals(arch, wl, trainer.sequence_parallel and trainer.tp > 1)
        if refused:
            problems.append(f"Tandem's Megatron engine refuses LoRA with {'; '.join(refused)}")
    if tg % (trainer.tp * trainer.pp * trainer.cp):
        problems.append(f"train GPUs {tg} are not a multiple of tp x pp x cp = {trainer.tp * trainer.pp * trainer.cp}")
    notes = []
    if trainer.micro_batch_tokens < wl.seq_len:  # Tandem refuses a row longer than a micro-batch: judge one row
        notes.append(f"micro_batch_tokens {trainer.micro_batch_tokens} < one sequence ({wl.seq_len} tokens): judged "
                     f"with micro-batches of one sequence (Tandem refuses longer rows)")
        trainer = replace(trainer, micro_batch_tokens=wl.seq_len)
    offloaded, building = _host_need(arch, dev, wl, trainer)
    if offloaded > dev.host_memory_gib * GIB:
        problems.append(f"offloaded state needs {offloaded / GIB:.0f} GiB of host memory per node > "
                        f"{dev.host_memory_gib:.0f} GiB")
    if building > dev.host_memory_gib * GIB:
        whole = trainer.engine == "fsdp" and not arch.native and building >= 4.0 * arch.total_params()
        problems.append(f"building the model needs {building / GIB:.0f} GiB of host memory per node > "
                        f"{dev.host_memory_gib:.0f} GiB" + (
                            f" (each of its {min(tg, dev.gpus_per_node)} ranks loads the whole HF model in fp32 "
                            "first; Tandem's sharded load covers the native model and the HF families of memory.HF_ROWS_READ, "
                            "docs/training.md)" if whole else ""))
    titems = trainer_memory(arch, dev, wl, trainer)
    iitems = inference_memory(arch, dev, wl, inference)
    if placement == "colocated":
        if dev.is_cpu:
            peak_t, peak_i = _cpu_colocated(titems, iitems, wl, gpus)
        else:
            resident = iitems["weights"] if inference.engine == "torch" else GPU_ASLEEP_RESIDUAL
            peak_t, peak_i = _total(titems) + resident, _total(iitems) + GPU_ASLEEP_RESIDUAL
    else:
        peak_t, peak_i = _total(titems), _total(iitems)
    if peak_t > cap:
        problems.append(f"trainer needs {peak_t / GIB:.1f} GiB per GPU ({_items_text(titems)}) > {cap / GIB:.1f} GiB")
    if inference.engine != "torch" and iitems["kv_cache"] <= 0:
        problems.append(f"rollout weights {iitems['weights'] / GIB:.1f} GiB per GPU + engine overhead exceed "
                        f"mem_fraction {inference.mem_fraction} x {dev.memory_gib} GiB: no KV cache left")
    elif peak_i > cap + HEADROOM * dev.memory_gib * GIB * (inference.engine != "torch"):
        problems.append(f"rollout needs {peak_i / GIB:.1f} GiB per GPU > {cap / GIB:.1f} GiB")
    p = Plan(fits=not problems, reason="fits" if not problems else "does not fit: " + "; ".join(problems), arch=arch,
             device=dev, workload=wl, gpus=gpus, trainer=trainer, inference=inference, placement=placement,
             train_gpus=tg, rollout_gpus=rg, trainer_items=titems, inference_items=iitems,
             memory_gib={"trainer": peak_t / GIB, "inference": peak_i / GIB, "capacity": cap / GIB}, why=notes)
    if inference.gpus <= rg and tg > 0:
        p.times, p.concurrency = _times(arch, dev, wl, trainer, inference, placement, tg, rg)
        if inference.engine != "torch" and p.concurrency == 0 and p.fits:
            p.fits, p.reason = False, "does not fit: the KV cache cannot hold one sequence"
    return p
