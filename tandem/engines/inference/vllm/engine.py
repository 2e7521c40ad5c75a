"""`VLLMEngine`: vLLM behind Tandem's `InferenceEngine` protocol (token ids in, token ids + log-probs out).

    engine = VLLMEngine(VLLMEngineConfig(model=ModelConfig(name="smollm2-135m-instruct", dtype="bfloat16")))
    [result] = engine.generate([GenerationRequest(prompt_token_ids=ids, sampling=SamplingParams(n=4))])
    engine.update_weights(trainer_tensors, version=1)

* Log-probs follow Tandem's convention, log_softmax(logits / T) of the sampled token over the full
  vocabulary: vLLM runs with ``logprobs_mode="processed_logprobs"`` (after temperature; its default,
  ``raw_logprobs``, ignores the temperature). Under top-k / top-p vLLM renormalises over the kept
  tokens, so such requests are refused unless ``filtered_logprobs="renormalized"``.
* Weight updates reload every weight through the worker's ``reload_weights`` (vLLM repacks weights
  on CPU, so copying into its parameters is not possible). The update is checked first (names,
  shapes, completeness); the version moves only after the reload returned.
* Sleep/wake use vLLM's sleep mode where vLLM has one (CUDA, ROCm, XPU); elsewhere ``sleep`` raises
  `SleepNotSupportedError` and the engine keeps serving.
* LoRA: with ``lora_alpha`` set, ``load_lora_adapter`` takes adapter tensors (peft names) and serves
  them as a vLLM LoRA adapter for every later request; merged full weights go through update_weights.

See docs/vllm.md.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import random
import shutil
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tandem.core.protocols import (
    CapabilityError,
    EngineAsleepError,
    EngineClosedError,
    EngineInfo,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    NamedTensors,
)
from tandem.engines.inference.vllm.config import VLLMEngineConfig
from tandem.engines.inference.vllm.requests import (
    RequestState,
    check_request,
    derive_seed,
    error_result,
    vllm_sampling,
)
from tandem.engines.inference.vllm.weights import (
    CheckpointIndex,
    lora_adapter_folder,
    stage_folder,
    staging_root,
    untied_view,
)
from tandem.models.registry import resolve_model

__all__ = ["EngineAsleepError", "SleepNotSupportedError", "VLLMEngine", "vllm_available"]

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'tandem-rl[vllm]' (CPU: scripts/install_vllm.sh builds a separate venv)"


class SleepNotSupportedError(CapabilityError):
    """vLLM has no sleep mode on this device (it needs CUDA, ROCm or XPU): ``info.can_sleep`` is False."""


def vllm_available() -> str | None:
    """None if vLLM imports here, else why not (a one-line reason)."""
    try:
        import vllm  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means "not usable here"
        return f"vllm does not import ({type(e).__name__}: {e}); {INSTALL_HINT}"
    return None


class VLLMEngine:
    """Generation, log-probs, weight updates, sleep and LoRA on vLLM (see the module docstring)."""

    def __init__(self, config: VLLMEngineConfig) -> None:
        reason = vllm_available()
        if reason is not None:
            raise ImportError(reason)
        if config.model is None:
            raise ValueError("VLLMEngineConfig.model is None: name the model")
        self.config = config
        self.model_path = resolve_model(config.model.name)
        hf = json.loads((self.model_path / "config.json").read_text())
        self.vocab_size = int(hf["vocab_size"])
        limit = int(hf.get("max_position_embeddings") or config.max_model_len)
        if config.max_model_len > limit:
            raise ValueError(
                f"max_model_len={config.max_model_len} exceeds the model's max_position_embeddings={limit}"
            )
        self.tied = bool(hf.get("tie_word_embeddings"))
        self.moe_layers = _moe_layers(self.model_path, hf)  # for the run's contract (vLLM returns no routes)
        self.index = CheckpointIndex(self.model_path, tied_embeddings=self.tied)
        self.dtype = config.model.torch_dtype
        self._staged: list[Path] = []  # folders to remove at close (untied view, LoRA adapters)
        # vLLM reads this folder: the model itself, or (tied embeddings) a view with an untied head
        self.vllm_model_path = self.model_path
        if self.tied:
            self.vllm_model_path = untied_view(self.model_path, staging_root(config.staging_dir), self.dtype)
            self._staged.append(self.vllm_model_path)
        self.device, self._sleep_mode = _platform()
        _bind_cpu_threads(config.cpu_threads_bind, self.device)
        kwargs = self._engine_kwargs()
        if config.backend == "inprocess":
            from tandem.engines.inference.vllm.backends import InprocessBackend

            self.backend: Any = InprocessBackend(kwargs)
        else:
            from tandem.engines.inference.vllm.backends import AsyncBackend

            self.backend = AsyncBackend(kwargs)
        self._version = 0
        self._seed_rng = random.Random(config.seed)
        self._lock = threading.Lock()
        self._inflight: dict[str, RequestState] = {}
        self._lora: Any = None
        self._lora_ids = itertools.count(1)
        self._adapters: list[Path] = []  # folders of loaded LoRA adapters (the newest is in use)
        self._sleeping = False
        self._closed = False
        self._stats = {"generated_tokens": 0, "requests": 0, "weight_updates": 0, "reload_seconds": 0.0}
        import vllm

        self._info = EngineInfo(
            name="vllm", version=str(getattr(vllm, "__version__", "")), dtype=config.model.dtype,
            moe_layers=self.moe_layers, max_context=config.max_model_len, vocab_size=self.vocab_size,
            can_sleep=self._sleep_mode, lora_adapters=config.lora_alpha is not None,
        )

    def _engine_kwargs(self) -> dict[str, Any]:
        cfg = self.config
        kwargs: dict[str, Any] = {"enforce_eager": True, "disable_log_stats": True}  # CPU: compiling costs minutes
        if self.device == "cpu":
            # With chunked prefill vLLM may split a prompt over two steps and then rewinds that request's
            # seeded sampler (Generator.set_offset), which CPU generators lack: every request of the step
            # fails ("CPU Generator does not use offset"; the async engine core dies). Unsplit prompts never
            # rewind. vLLM warns that the model "does not officially support" this; outputs are tested.
            kwargs["enable_chunked_prefill"] = False
        kwargs.update(cfg.engine_kwargs)
        kwargs.update(
            model=str(self.vllm_model_path),
            dtype=cfg.model.dtype,
            max_model_len=cfg.max_model_len,
            seed=cfg.seed,
            logprobs_mode="processed_logprobs",
        )
        if cfg.lora_alpha is not None:
            kwargs.update(enable_lora=True)
            kwargs.setdefault("max_lora_rank", cfg.lora_max_rank)
        return kwargs

    # -- the InferenceEngine protocol -------------------------------------------------------------------

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def info(self) -> EngineInfo:
        """Not deterministic (vLLM's kernels: a bounded contract), no score(), no routed experts, whole-model
        updates only; sleeps where vLLM has a sleep mode; LoRA adapters with ``lora_alpha`` set."""
        return self._info

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Blocking generation; results in request order. A bad request fails alone (finish reason ERROR)."""
        futures = [self._submit(r) for r in requests]
        self.backend.wait(futures)
        return [f.result() for f in futures]

    async def agenerate(self, request: GenerationRequest) -> GenerationResult:
        """Generate one request; concurrent calls share vLLM's running batch. Cancelling aborts it."""
        import asyncio

        future = self._submit(request)
        try:
            await self.backend.await_future(future)
        except asyncio.CancelledError:
            self.abort(request.request_id)
            raise
        return future.result()

    def abort(self, request_id: str) -> None:
        """Finish a request now: its result holds the tokens generated so far, finish reason ABORT."""
        with self._lock:
            state = self._inflight.get(request_id)
        if state is not None:
            self.backend.abort(state.vllm_ids)

    def abort_all(self) -> None:
        with self._lock:
            ids = [i for s in self._inflight.values() for i in s.vllm_ids]
        if ids:
            self.backend.abort(ids)

    def update_weights(self, named_tensors: NamedTensors, version: int) -> None:
        """Reload every weight from HF-named tensors; afterwards ``weight_version == version``.

        The update is checked (every checkpoint weight present, shapes, floating point) before vLLM sees
        it, so a rejected update leaves the engine on its weights and version. In-flight requests
        continue on the new weights (their ``weight_versions`` record the switch).
        """
        items = list(named_tensors)
        self.index.check(items, version)
        if self.tied and not any(name == "lm_head.weight" for name, _ in items):
            items.append(("lm_head.weight", dict(items)["model.embed_tokens.weight"]))  # the untied head
        if self.config.backend == "inprocess":
            # cast lazily, one tensor at a time (vLLM would cast too, warning once per tensor)
            dtype = self.dtype
            self._reload(((n, t.to(dtype) if t.is_floating_point() else t) for n, t in items), version)
            return
        folder = stage_folder(items, staging_root(self.config.staging_dir), self.vllm_model_path, self.dtype)
        try:
            self._reload(str(folder), version)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def update_weights_from_path(self, path: str | os.PathLike, version: int) -> None:
        """Reload every weight from a safetensors folder (another process wrote it); checked first."""
        folder = Path(path)
        self.index.check_folder(folder, version)
        if not self.tied or CheckpointIndex(folder, tied_embeddings=False).shapes.get("lm_head.weight"):
            self._reload(str(folder), version)
            return
        view = untied_view(folder, staging_root(self.config.staging_dir), self.dtype)
        try:
            self._reload(str(view), version)
        finally:
            shutil.rmtree(view, ignore_errors=True)

    def _reload(self, weights: Any, version: int) -> None:
        import time

        self._check_awake("update weights")
        t0 = time.perf_counter()
        try:
            self.backend.reload(weights, int(version))
        except Exception as e:
            # The checks above passed, so vLLM itself failed mid-reload: its weights are unknown now.
            self.backend.last_error = f"weight reload to version {version} failed: {type(e).__name__}: {e}"
            raise RuntimeError(
                f"{self.backend.last_error}; the engine's weights may be partly updated (still version "
                f"{self._version}): send a full update again"
            ) from e
        self._version = int(version)
        self._lora = None  # full weights replace any adapter
        self._stats["weight_updates"] += 1
        self._stats["reload_seconds"] += time.perf_counter() - t0

    def load_lora_adapter(self, named_tensors: NamedTensors, version: int) -> None:
        """Serve LoRA adapter tensors (peft names) on the base weights from now on (adapter-only sync)."""
        if self.config.lora_alpha is None:
            raise ValueError(
                "load_lora_adapter: VLLMEngineConfig.lora_alpha is not set (vLLM LoRA is off); set it to the "
                "trainer's LoRA alpha, or send merged weights (sync.lora_mode: merged)"
            )
        self._check_awake("load a LoRA adapter")
        folder = lora_adapter_folder(
            list(named_tensors), staging_root(self.config.staging_dir), self.index,
            alpha=self.config.lora_alpha, max_rank=self.config.lora_max_rank,
        )
        self._adapters.append(folder)
        self.load_lora_adapter_from_path(folder, version, name=f"tandem-v{version}")

    def load_lora_adapter_from_path(self, path: str | os.PathLike, version: int, *, name: str | None = None) -> None:
        """Serve the peft adapter folder ``path`` (by ``name``) for every later request."""
        from vllm.lora.request import LoRARequest

        if self.config.lora_alpha is None:
            raise ValueError("load_lora_adapter_from_path: VLLMEngineConfig.lora_alpha is not set (vLLM LoRA is off)")
        lora = LoRARequest(lora_name=name or Path(path).name, lora_int_id=next(self._lora_ids), lora_path=str(path))
        self.backend.add_lora(lora, int(version))
        self._lora, self._version = lora, int(version)
        while len(self._adapters) > 2:  # keep the adapter in use and the previous one (in-flight requests)
            shutil.rmtree(self._adapters.pop(0), ignore_errors=True)

    def sleep(self) -> None:
        """Free the KV cache (and, at ``sleep_level`` 1, offload the weights) for a colocated trainer."""
        if not self._info.can_sleep:
            raise SleepNotSupportedError(
                f"vLLM sleep mode is not supported on this device ({self.device}): it needs CUDA, ROCm or XPU. "
                "The engine keeps its memory and keeps serving (info.can_sleep is false: the loop skips sleep)"
            )
        if self.backend.in_flight():
            raise EngineAsleepError(
                f"sleep() with {self.backend.in_flight()} request(s) in flight: finish or abort them first"
            )
        self.backend.sleep(self.config.sleep_level)
        self._sleeping = True

    def wake_up(self) -> None:
        if not self._info.can_sleep:
            raise SleepNotSupportedError(f"vLLM sleep mode is not supported on this device ({self.device})")
        if self._sleeping:
            self.backend.wake_up()
            self._sleeping = False

    def health(self) -> dict[str, Any]:
        status = "closed" if self._closed else ("sleeping" if self._sleeping else "ok")
        with self._lock:
            running = len(self._inflight)
        return {
            "status": status,
            "weight_version": self._version,
            "backend": self.config.backend,
            "running": running,
            "device": self.device,
            "dtype": str(self.dtype).removeprefix("torch."),
            "lora": self._lora.lora_name if self._lora is not None else None,
            "last_error": self.backend.last_error,
            **self._stats,
        }

    # -- lifecycle ---------------------------------------------------------------------------------------

    def close(self) -> None:
        """Abort what is in flight (partial results, finish reason ABORT) and stop vLLM."""
        if self._closed:
            return
        self._closed = True
        self.abort_all()
        with self._lock:
            states = list(self._inflight.values())
        for state in states:
            state.finish_all(FinishReason.ABORT)
        self.backend.shutdown()
        for folder in self._staged + self._adapters:
            shutil.rmtree(folder, ignore_errors=True)

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- requests ----------------------------------------------------------------------------------------

    def _check_awake(self, what: str) -> None:
        if self._sleeping:
            raise EngineAsleepError(f"the engine is asleep: call wake_up() before you {what}")
        if self._closed:
            raise EngineClosedError("the engine is closed")

    def _submit(self, request: GenerationRequest):
        if not isinstance(request, GenerationRequest):
            raise TypeError(f"requests must be GenerationRequest objects, got {type(request).__name__}")
        self._check_awake("generate")
        cfg = self.config
        checked = check_request(
            request, vocab_size=self.vocab_size, max_model_len=cfg.max_model_len,
            filtered_logprobs=cfg.filtered_logprobs,
        )
        if isinstance(checked, str):
            return _done(error_result(request, checked))
        if request.lora not in (None, "base"):  # one adapter at a time here: the synced one, by default
            return _done(error_result(request, f"lora={request.lora!r}: the vLLM adapter serves only the synced "
                                               "adapter (lora=None) or the base model (lora='base')"))
        prompt, params = checked
        with self._lock:
            if request.request_id in self._inflight:
                return _done(error_result(request, f"request_id {request.request_id!r} is already in flight"))
            base = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
            state = RequestState(request, prompt, params, [derive_seed(base, i) for i in range(params.n)])
            self._inflight[request.request_id] = state
        state.future.add_done_callback(lambda _f, rid=request.request_id: self._forget(rid))
        self._stats["requests"] += 1
        lora = self._lora if request.lora is None else None
        for i, (vllm_id, seed) in enumerate(zip(state.vllm_ids, state.seeds, strict=True)):
            try:
                self.backend.add(vllm_id, prompt, vllm_sampling(params, seed), lora, self._on_output(state, i))
            except Exception as e:  # noqa: BLE001 - vLLM refused this request: it fails alone
                state.finish(i, FinishReason.ERROR, f"vLLM rejected the request: {type(e).__name__}: {e}")
        return state.future

    def _on_output(self, state: RequestState, index: int):
        def on_output(output: Any) -> None:
            if output is None:
                state.finish(index, FinishReason.ABORT)
            elif isinstance(output, Exception):
                state.finish(index, FinishReason.ERROR, str(output))
            else:
                try:
                    self._stats["generated_tokens"] += state.deliver(index, output, self._version)
                except Exception as e:  # noqa: BLE001 - a malformed output fails this sample only
                    state.finish(index, FinishReason.ERROR, f"{type(e).__name__}: {e}")

        return on_output

    def _forget(self, request_id: str) -> None:
        with self._lock:
            self._inflight.pop(request_id, None)


def _moe_layers(model_path: Path, hf: dict[str, Any]) -> tuple[int, ...]:
    """The decoder layers with routed experts: from Tandem's description of the architecture where it has
    one, else every layer of a config that declares experts (vLLM may serve architectures Tandem does not
    implement)."""
    if not any(int(hf.get(k) or 0) > 0 for k in ("num_experts", "num_local_experts", "n_routed_experts")):
        return ()
    from transformers import AutoConfig

    from tandem.models.transformer import TransformerArgs, UnsupportedModelError

    try:
        return tuple(TransformerArgs.from_hf_config(AutoConfig.from_pretrained(str(model_path))).moe_layers)
    except UnsupportedModelError:
        return tuple(range(int(hf.get("num_hidden_layers") or 0)))


def _done(result: GenerationResult):
    import concurrent.futures

    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_result(result)
    return future


def _platform() -> tuple[str, bool]:
    """vLLM's device type (``cpu``, ``cuda``, ...) and whether it has a sleep mode there."""
    from vllm.platforms import current_platform

    return str(getattr(current_platform, "device_type", "") or "cpu"), bool(current_platform.is_sleep_mode_available())


def _bind_cpu_threads(bind: str | None, device: str) -> None:
    """Let vLLM's CPU worker use every core (by default it binds one core and reserves the others)."""
    if device != "cpu" or bind is None or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return
    cores = ",".join(str(c) for c in sorted(os.sched_getaffinity(0))) if bind == "all" else bind
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cores
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
