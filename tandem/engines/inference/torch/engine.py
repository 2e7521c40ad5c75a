"""`TorchEngine`: the embedded inference engine (satisfies `tandem.core.protocols.InferenceEngine`).

It runs Tandem's native model (tandem/models/transformer.py) with a preallocated KV cache and
continuous batching. There is no background thread: whoever waits for results drives the engine.
`generate` (blocking) enqueues its requests and runs steps in the calling thread until they are done;
`agenerate` (asyncio) enqueues and awaits while one driver task per event loop runs steps, yielding
between steps, so concurrent calls join one running batch. Each step admits waiting requests as slots free up, runs one
forward over every running sequence (decode tokens and prompt chunks mixed), samples, and resolves
finished requests, whoever's they are. A step lock serialises steps from several threads;
`update_weights` and `sleep` take it too, so they land between two steps.

Running steps in the caller's thread matters on a CPU: a second thread doing torch work gives the
process a second OpenMP team, and with more OpenMP threads than cores libgomp stops spinning at its
barriers; a decode step of SmolLM2 at 32 sequences then took 77 ms instead of 57 (measured).

    engine = TorchEngine(TorchEngineConfig(model=ModelConfig(name="smollm2-135m-instruct")))
    [result] = engine.generate([GenerationRequest(prompt_token_ids=ids, sampling=SamplingParams(n=4))])

See docs/inference.md for the design, the log-prob convention and the deterministic mode.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import random
import threading
import time
import weakref
from collections.abc import Iterator
from collections.abc import Sequence as SequenceABC
from typing import Any

import numpy as np
import torch

import tandem
from tandem.core.protocols import (
    EngineAsleepError,
    EngineClosedError,
    EngineInfo,
    FinishReason,
    FrozenBase,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
)
from tandem.engines.inference.common import derive_seed, error_result
from tandem.engines.inference.torch.config import TorchEngineConfig
from tandem.engines.inference.torch.kv_cache import KVCache, StepAttention
from tandem.engines.inference.torch.lora import AdapterMethods, ServedAdapters
from tandem.engines.inference.torch.sampling import RowSampler, sample_tokens
from tandem.engines.inference.torch.scheduler import Phase, RequestState, Scheduler, StepPlan
from tandem.engines.inference.torch.scoring import ScoringMethods
from tandem.engines.inference.torch.speculative import (
    SpecStats,
    apply_verification,
    draft_for_verification,
    make_drafter,
)
from tandem.engines.inference.torch.weights import WeightMethods
from tandem.kernels.load import DequantizeOnLoad
from tandem.models.attention import MoERouting
from tandem.models.lean_ops import pointwise_kernels, silu_override
from tandem.models.registry import resolve_model
from tandem.models.transformer import CausalLM
from tandem.ops.batch_invariant import KEY_TILE, invariant_silu, round_up
from tandem.ops.linear import fast_linear_scope, install_fast_linears, linear

__all__ = ["EngineAsleepError", "TorchEngine"]

log = logging.getLogger(__name__)


class TorchEngine(WeightMethods, AdapterMethods, ScoringMethods):
    """Batched generation with a KV cache, log-probs, live weight updates, LoRA adapters served unmerged
    (`tandem.engines.inference.torch.lora`) and a batch-invariant mode."""

    def __init__(self, config: TorchEngineConfig, *, model: CausalLM | None = None,
                 base: FrozenBase | None = None) -> None:
        """``base``: what a colocated trainer keeps frozen and never writes (a LoRA base: its ``frozen_weights()``,
        (HF name, tensor) and, of a QLoRA base, (HF name, quantized tensors)), held from the start instead of
        read from the model files: the plain tensors as those weights (those of another shape, dtype or device
        are read; copy-on-write as with `share_weights`), the quantized ones, where ``quantization`` targets the
        weight, as the weight held quantized (dequantized one at a time to pack; their values are the trainer's)."""
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        device = torch.device(config.device)
        self._owns_model = model is None  # a caller's model keeps its plain weights (`_drop_plain`)
        plain, quantized = base if base is not None and model is None else ((), ())
        given = {name: t.detach() for name, t in plain}
        held = {name: {k: v.detach() for k, v in ts.items()} for name, ts in quantized} if config.quantization else {}
        if model is None:
            if config.model is None:
                raise ValueError("TorchEngineConfig.model is None: name the model (or pass model=)")
            model = CausalLM.from_pretrained(
                resolve_model(config.model.name), dtype=config.model.torch_dtype, device=device, given=given,
                unallocated=held.keys())
        self.model = model.eval().requires_grad_(False)
        install_fast_linears(self.model)  # its linears honour fast_linear_scope (each step's numerics)
        args = self.model.args
        if config.max_model_len > args.max_position_embeddings:
            raise ValueError(
                f"max_model_len={config.max_model_len} exceeds the model's max_position_embeddings="
                f"{args.max_position_embeddings}"
            )
        self._quant = DequantizeOnLoad(self.model, config.quantization) if config.quantization else None
        if self._quant is not None:
            self._own_given(given, self._quant.weight_names)  # apply writes them in place: copies of its own
            self._quant.apply(self.model)  # the model files' weights, quantized then dequantized
        # deterministic attention reads keys in whole tiles, so slots are whole tiles long
        slot_len = round_up(config.max_model_len, KEY_TILE) if config.deterministic else config.max_model_len
        num_slots = min(config.num_seqs, config.cache_tokens // slot_len)
        if num_slots < 1:
            raise ValueError(
                f"kv_cache_tokens={config.cache_tokens} holds no sequence slot of {slot_len} tokens "
                f"(max_model_len={config.max_model_len}, rounded up to a multiple of {KEY_TILE} in deterministic mode)"
            )
        self.cache = KVCache(
            num_layers=args.num_layers,
            num_slots=num_slots,
            num_kv_heads=args.num_kv_heads,
            slot_len=slot_len,
            head_dim=args.head_dim,
            dtype=self.model.dtype,
            device=device,
        )
        self.scheduler = Scheduler(num_slots, config.prefill_chunk)
        self._native_attention = config.native_kernel("decode_attention", config.decode_attention, device)
        self._native_sampler = config.native_kernel("sample", config.sampler, device)
        self._native_pointwise = config.native_kernel("pointwise", config.pointwise, device)
        self._weights = dict(self.model.state_dict(keep_vars=True))  # HF names (tied alias included)
        self.adapters = ServedAdapters(self.model, max_adapters=config.max_loras, max_rank=config.lora_max_rank)
        self._policy_adapter: str | None = None  # what requests without ``lora`` use (load_lora_adapter's)
        # oneDNN-packed weight copies; the numerics mode of every step reads this dict
        self._packed: dict[int, torch.Tensor] = {}
        self._plain_needed: set[int] = set()  # packed weights whose plain copy stays (merged LoRA targets)
        self._freed: dict[int, torch.Tensor] = {}  # packed-only weights sleep freed -> a packed tensor of their layout
        self._asleep: dict[int, tuple] = {}  # weights a quantized engine holds quantized since it slept (weights.py)
        self._shared: set[int] = set()  # weights that view a colocated trainer's frozen tensors (share_weights)
        self._frozen_quant: dict[int, dict] = {}  # weight id -> a QLoRA trainer's quantized tensors of it
        self._hold_given(given, held)
        if not self._packs():
            self._restore_asleep()  # weights held quantized stay so only where the steps read packed copies
        self._pack()
        self._restore_asleep(keep=self._packed)  # as wake_up: any the packing did not cover gets its plain copy
        self._version = 0
        self._seed_rng = random.Random(config.seed)
        self._sleeping = False
        self._paused = False  # pause_generation: no step runs, sequences keep their place and cache
        self._drafter = make_drafter(self.model, config.speculative) if config.speculative is not None else None
        self._spec_stats = SpecStats()
        self._stats = {"steps": 0, "prompt_tokens_computed": 0, "generated_tokens": 0, "step_seconds": 0.0}
        self._last_error: str | None = None
        self._inflight: set[str] = set()
        self._inbox: list[RequestState] = []
        self._aborts: list[str | None] = []
        self._closed = False
        self._inbox_lock = threading.Lock()
        self._step_lock = threading.RLock()  # held while a step runs; weight updates and sleep take it
        self._priority_waiters = 0  # callers of update_weights/sleep/... waiting: drivers let them in first
        self._drivers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> driver task
        self._info = EngineInfo(
            name="torch", version=tandem.__version__, dtype=str(self.model.dtype).removeprefix("torch."),
            deterministic=config.deterministic, moe_layers=tuple(args.moe_layers), max_context=config.max_model_len,
            vocab_size=args.vocab_size, can_sleep=True, can_score=True, routed_experts=bool(args.moe_layers),
            exposes_weights=True, partial_updates=True, lora_adapters=config.lora_alpha is not None,
        )

    # -- the InferenceEngine protocol -------------------------------------------------------------------

    @property
    def info(self) -> EngineInfo:
        """Sleeps, scores, returns routed experts for MoE models, takes partial updates, exposes its weights;
        serves LoRA adapters unmerged where ``lora_alpha`` is set (``sync.lora_mode: adapter``)."""
        return self._info

    @property
    def weight_version(self) -> int:
        return self._version

    def generate(self, requests: SequenceABC[GenerationRequest]) -> list[GenerationResult]:
        """Blocking generation; results in request order. A bad request fails alone (finish reason ERROR).

        Steps run in the calling thread; concurrent callers (threads, coroutines) share the batch.
        """
        futures = [self._submit(r) for r in requests]
        while not all(f.done() for f in futures):
            if not self._drive(blocking=True):  # another thread's step is finishing our requests
                concurrent.futures.wait(futures, timeout=0.01, return_when=concurrent.futures.FIRST_COMPLETED)
        return [f.result() for f in futures]

    async def agenerate(self, request: GenerationRequest) -> GenerationResult:
        """Generate one request; concurrent calls join the running batch. Cancelling aborts it.

        Steps run on the event loop, in one driver task per loop (one step, ~a decode step of the batch,
        between two yields). Callers only await their result: if every caller drove steps itself, a
        request arriving through a slow path (an HTTP stack needs a few loop iterations) would join a
        batch that advanced one step per waiting caller, and sequences would decode out of phase in
        small batches (measured with `tandem serve` at 32 sessions: 1.8x the engine steps).
        """
        result = asyncio.wrap_future(self._submit(request))
        try:
            while not result.done():
                driver = self._driver_task()
                await asyncio.wait({result, driver}, return_when=asyncio.FIRST_COMPLETED)
                if driver.done() and not driver.cancelled() and driver.exception() is not None:
                    raise driver.exception()
            return result.result()
        except asyncio.CancelledError:
            self.abort(request.request_id)
            raise

    def _driver_task(self) -> asyncio.Task:
        """This event loop's driver task (started if there is none)."""
        loop = asyncio.get_running_loop()
        task = self._drivers.get(loop)
        if task is None or task.done():
            task = self._drivers[loop] = loop.create_task(self._drive_loop(), name="tandem-engine-driver")
            # its error reaches the awaiting callers; one nobody awaits any more (a stop signal raised
            # inside a step) must not be logged as "never retrieved"
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return task

    async def _drive_loop(self) -> None:
        """Step while there is work; end when there is none (the next `agenerate` starts a new one)."""
        await asyncio.sleep(0)  # let coroutines started together submit before the first step
        while True:
            if self._drive(blocking=False):
                await asyncio.sleep(0)
            elif self._inbox or self.scheduler.running or self.scheduler.waiting:
                # another thread is stepping, an update holds the lock, or generation is paused
                await asyncio.sleep(0.01 if self._paused else 0.001)
            else:
                return

    def abort(self, request_id: str) -> None:
        """Finish a request now: its result holds the tokens generated so far, finish reason ABORT."""
        self._enqueue_abort(request_id)

    def abort_all(self) -> None:
        self._enqueue_abort(None)

    def sleep(self) -> None:
        """Free the KV cache for a colocated trainer (with ``sleep_frees_weights``, the packed-only weights too,
        which an update must rewrite before `wake_up`). Requests must be finished or aborted first."""
        with self._between_steps():
            self._absorb()
            with self._inbox_lock:
                busy = len(self._inflight)
            if busy:
                raise EngineAsleepError(
                    f"sleep() with {busy} request(s) in flight: finish or abort them first"
                )
            self._sleeping = True
            self.cache.release()
            self._release_packed()  # a packed-only weight's packed copy is the weight: it stays, unless
            if self.config.sleep_frees_weights:
                self._free_weights()  # the next update is to rewrite it
            self._quantize_asleep()  # a quantized engine's plain weights: their format's bits until wake_up
            self.adapters.merged = None

    def wake_up(self) -> None:
        """Allocate the KV cache and re-pack (weights held quantized are packed from their dequantized values and
        stay held; weights.py); refused (the engine stays asleep) while a weight that sleep freed
        (``sleep_frees_weights``) has not been rewritten by `update_weights`."""
        with self._between_steps():
            self._check_weights_held("wake_up()")
            if not self._packs():
                self._restore_asleep()  # else weights held quantized stay so: _pack packs them from their values
            self.cache.allocate()
            self._pack()
            self._restore_asleep(keep=self._packed)  # any the packing did not cover gets its plain copy
            self._sleeping = False

    def train_drafter(self) -> dict[str, float]:
        """Train the draft head (``speculative.drafter: draft_head``) on the rollouts since its last training;
        runs at every weight update. Its loss and counters (also in `health`); {} for other drafters."""
        train = getattr(self._drafter, "train", None)
        return train() if train is not None else {}

    def drafter_state(self) -> dict[str, torch.Tensor]:
        """The draft head's state (``speculative.drafter: draft_head``, once trained) for a checkpoint; {} for
        other drafters or an untrained head. Taken between two steps."""
        state = getattr(self._drafter, "state_dict", None)
        if state is None:
            return {}
        with self._between_steps():
            return state()

    def load_drafter_state(self, state: dict[str, torch.Tensor]) -> None:
        """Restore `drafter_state` (a resumed run): the head drafts from the next step. A state for another
        model, or an engine without a draft head, is refused with a ValueError naming why."""
        load = getattr(self._drafter, "load_state_dict", None)
        if load is None:
            raise ValueError("load_drafter_state: this engine has no draft head (speculative.drafter: draft_head)")
        with self._between_steps():
            load(state)

    def pause_generation(self) -> None:
        """Hold every request where it is (SGLang's in-place pause): no step runs until
        `continue_generation`; updates, aborts and health still work; sequences keep their cache."""
        self._paused = True

    def continue_generation(self) -> None:
        self._paused = False

    def health(self) -> dict[str, Any]:
        sched = self.scheduler
        status = "closed" if self._closed else ("sleeping" if self._sleeping else "ok")
        return {
            "status": status,
            "weight_version": self._version,
            "paused": self._paused,
            "running": len(sched.running),
            "waiting": sched.num_waiting + sum(r.params.n for r in list(self._inbox)),
            "free_slots": len(sched.free_slots),
            "num_slots": self.cache.num_slots,
            "kv_cache_tokens": self.cache.num_slots * self.cache.slot_len,
            "kv_cache_bytes": self.cache.nbytes if self.cache.allocated else 0,
            "packed_weight_bytes": sum(w.numel() * w.element_size() for w in self._packed.values()),
            "plain_weight_bytes": sum(w.numel() * w.element_size() for w in self.model.parameters()
                                      if not w.is_meta and id(w) not in self._shared),
            # weights that view a colocated trainer's frozen tensors (share_weights): that memory is the trainer's
            "shared_weight_bytes": sum(w.numel() * w.element_size() for w in self.model.parameters()
                                       if id(w) in self._shared),
            "freed_weight_bytes": sum(t.numel() * t.element_size() for t in self._freed.values()),
            "lora_merged": self.adapters.merged.name if self.adapters.merged is not None else None,
            "deterministic": self.config.deterministic,
            "decode_attention": "native" if self._native_attention is not None else "torch",
            "sampler": "native" if self._native_sampler is not None else "torch",
            "pointwise": "native" if self._native_pointwise is not None else "torch",
            "quantization": self.config.quantization.format if self.config.quantization else None,
            "dtype": str(self.model.dtype).removeprefix("torch."),
            "device": str(self.cache.device),
            "last_error": self._last_error,
            **self._stats,
            **(self._spec_stats.as_dict() | self._drafter.stats if self._drafter is not None else {}),
        }

    # -- lifecycle ---------------------------------------------------------------------------------------

    def close(self) -> None:
        """Abort what is in flight (partial results, finish reason ABORT) and refuse new requests."""
        if self._closed:
            return
        self._closed = True
        self.abort_all()
        with self._between_steps():
            self._absorb()

    def __enter__(self) -> TorchEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- requests ----------------------------------------------------------------------------------------

    def _submit(self, request: GenerationRequest) -> concurrent.futures.Future:
        if not isinstance(request, GenerationRequest):
            raise TypeError(f"requests must be GenerationRequest objects, got {type(request).__name__}")
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self._sleeping:
            raise EngineAsleepError("the engine is asleep: call wake_up() before generating")
        if self._closed:
            raise EngineClosedError("the engine is closed")
        checked = self._check(request)
        if isinstance(checked, str):
            future.set_result(error_result(request, checked))
            return future
        prompt, params = checked
        with self._inbox_lock:
            if request.request_id in self._inflight:
                future.set_result(
                    error_result(request, f"request_id {request.request_id!r} is already in flight")
                )
                return future
            base = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
            seeds = [derive_seed(base, i) for i in range(params.n)]
            state = RequestState(request=request, prompt=prompt, params=params, future=future, seeds=seeds)
            self._inflight.add(request.request_id)
            future.add_done_callback(lambda _f, rid=request.request_id: self._forget(rid))
            self._inbox.append(state)
        return future

    def _forget(self, request_id: str) -> None:
        with self._inbox_lock:
            self._inflight.discard(request_id)

    def _enqueue_abort(self, request_id: str | None) -> None:
        with self._inbox_lock:
            self._aborts.append(request_id)
        # resolve it now if no step is running; otherwise the running step's driver does it next
        if self._step_lock.acquire(blocking=False):
            try:
                self._absorb()
            finally:
                self._step_lock.release()

    def _check(self, request: GenerationRequest) -> tuple[list[int], SamplingParams] | str:
        """The validated prompt and sampling parameters, or the error message for this request."""
        try:
            checked = request.check(vocab_size=self.model.args.vocab_size, max_model_len=self.config.max_model_len,
                                    routed_experts=self._info.routed_experts)
        except ValueError as e:
            return str(e)
        return self._check_adapter(request) or checked

    # -- driving -------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _between_steps(self) -> Iterator[None]:
        """Hold the step lock, ahead of drivers (a driver would otherwise re-take it step after step)."""
        with self._inbox_lock:
            self._priority_waiters += 1
        try:
            self._step_lock.acquire()
        finally:
            with self._inbox_lock:
                self._priority_waiters -= 1
        try:
            yield
        finally:
            self._step_lock.release()

    def _drive(self, *, blocking: bool) -> bool:
        """Run one step in the calling thread (if the step lock is free); whether a step ran."""
        if self._priority_waiters or not self._step_lock.acquire(blocking=blocking):
            return False
        try:
            self._absorb()
            if self._sleeping or self._paused or not (self.scheduler.running or self.scheduler.waiting):
                return False
            # not TorchFunctionModes (they cost ~1 us on every torch call of a step): tandem/ops/linear.py
            deterministic = self.config.deterministic
            with (torch.inference_mode(), fast_linear_scope(self._packed, invariant=deterministic),
                  silu_override(invariant_silu if deterministic else None),
                  pointwise_kernels(self._native_pointwise)):
                self._guarded_step()
            return True
        finally:
            self._step_lock.release()

    def _absorb(self) -> None:
        """Move newly submitted requests and aborts into the scheduler (step lock held)."""
        with self._inbox_lock:
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
        for state in inbox:
            # another request's prompt keys/values serve this one only under the same weights and adapter
            adapter = self._adapter_of(state.request)
            self.scheduler.add(state, share=(self._version, adapter, id(self.adapters.adapters.get(adapter))))
        for request_id in aborts:
            self.scheduler.abort(request_id)

    def _guarded_step(self) -> None:
        """One step; if it raises, the requests it touched fail (ERROR) and the engine keeps serving."""
        plan = None
        try:
            self.scheduler.admit(self._make_sampler)
            plan = self.scheduler.plan()
            if plan.sequences:
                self._step(plan)
        except Exception as e:  # noqa: BLE001 - a failed step must not take the engine down
            message = f"engine step failed: {type(e).__name__}: {e}"
            self._last_error = message
            log.exception("torch engine step failed")
            touched = {id(s.request): s.request for s in (plan.sequences if plan else [])}
            if plan is None:
                touched = {id(s.request): s.request for s in self.scheduler.running.values()}
            for state in touched.values():
                self.scheduler.fail(state, message)

    def _make_sampler(self, state: RequestState, index: int) -> RowSampler:
        p = state.params
        generator = torch.Generator().manual_seed(state.seeds[index])
        return RowSampler(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, generator=generator)

    def _step(self, plan: StepPlan) -> None:
        start = time.perf_counter()
        for src, dst, length in plan.copies:
            self.cache.copy_prefix(src, dst, length)
        if self._drafter is not None:
            draft_for_verification(plan, self._drafter, self.config)
        ids = [s.token_at(s.length - 1) for s in plan.decode]
        positions = [s.length - 1 for s in plan.decode]
        for seq, chunk in plan.prefill:
            ids += seq.request.prompt[chunk.start : chunk.start + chunk.count]
            positions += range(chunk.start, chunk.start + chunk.count)
        for seq, chunk, draft in plan.verify:
            ids += [seq.token_at(chunk.start), *draft]
            positions += range(chunk.start, chunk.start + chunk.count)
        device = self.cache.device
        ctx = StepAttention(
            self.cache,
            [s.slot for s in plan.decode],
            [s.length for s in plan.decode],
            [chunk for _, chunk in plan.prefill] + [chunk for _, chunk, _ in plan.verify],
            deterministic=self.config.deterministic,
            native_lib=self._native_attention,
        )
        wants_routing = any(s.request.params.return_routed_experts for s in plan.sequences)
        routing = MoERouting(self.model.args.moe_layers) if wants_routing else None
        with self.adapters.rows(self._row_adapters(plan) or [], device):
            hidden = self.model(
                torch.tensor(ids, dtype=torch.long, device=device),
                torch.tensor(positions, dtype=torch.long, device=device),
                ctx,
                routing,
            )
        # rows that produce a token: every decode row, and the last row of a prompt that completes
        rows, samplers, sampling = (
            list(range(len(plan.decode))),
            [s.sampler for s in plan.decode],
            list(plan.decode),
        )
        offset = len(plan.decode)
        for seq, chunk in plan.prefill:
            seq.num_cached += chunk.count
            offset += chunk.count
            if seq.num_cached == len(seq.request.prompt):
                rows.append(offset - 1)
                samplers.append(seq.sampler)
                sampling.append(seq)
                seq.phase = Phase.DECODE
        for seq in plan.decode:
            seq.num_cached += 1
        recorded = routing.recorded().cpu().numpy() if routing is not None else None
        if recorded is not None:
            self._record_routing(plan, recorded)
        verify_rows = list(range(offset, offset + sum(c.count for _, c, _ in plan.verify)))
        if rows or verify_rows:
            # the vocabulary projection exactly as models/logprobs.py computes it (F.linear, then float32;
            # `linear` is the step scope's product: fast_linear, or invariant_linear in the deterministic mode)
            picked = torch.tensor(rows + verify_rows, device=device)
            logits = linear(hidden[picked], self.model.lm_head.weight).float()
            learns = self._drafter is not None and self._drafter.needs_hidden
            lse = torch.logsumexp(logits, dim=-1) if learns else None  # the draft head's targets' normaliser
            if rows:
                tokens, log_probs = sample_tokens(logits[: len(rows)], samplers, self._native_sampler)
                if learns:
                    self._drafter.observe_rows(sampling, hidden[picked[: len(rows)]], tokens.tolist(), lse[: len(rows)])
                self._append(sampling, tokens.tolist(), log_probs.tolist())
            if verify_rows:
                emitted = apply_verification(self, plan, logits[len(rows):], hidden, recorded, offset,
                                             None if lse is None else lse[len(rows):])
        self._stats["steps"] += 1
        self._stats["prompt_tokens_computed"] += sum(c.count for _, c in plan.prefill)
        self._stats["generated_tokens"] += len(rows) + (emitted if verify_rows else 0)
        self._stats["step_seconds"] += time.perf_counter() - start

    def _record_routing(self, plan: StepPlan, recorded: np.ndarray) -> None:
        offset = 0
        for seq in plan.decode:
            if seq.request.params.return_routed_experts:
                self.scheduler.record_routing(seq, seq.length - 1, recorded[offset : offset + 1])
            offset += 1
        for seq, chunk in plan.prefill:
            if seq.request.params.return_routed_experts:
                self.scheduler.record_routing(seq, chunk.start, recorded[offset : offset + chunk.count])
            offset += chunk.count

    def _append(self, sequences, tokens: list[int], log_probs: list[float]) -> None:
        version = self._version
        for seq, token, log_prob in zip(sequences, tokens, log_probs, strict=True):
            if seq.phase is Phase.DONE:  # a speculated token past a stop token or a length limit
                continue
            seq.output.append(token)
            seq.log_probs.append(log_prob)
            if not seq.versions or seq.versions[-1] != version:
                seq.versions.append(version)
            params = seq.request.params
            if token in params.stop_token_ids:
                self.scheduler.finish(seq, FinishReason.STOP)
            elif len(seq.output) >= params.max_new_tokens or seq.length >= self.config.max_model_len:
                self.scheduler.finish(seq, FinishReason.LENGTH)
