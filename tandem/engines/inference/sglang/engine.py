"""`SGLangEngine`: Tandem's `InferenceEngine` over SGLang servers' native HTTP API.

Token ids in, token ids + the log-prob of each sampled token out (``/generate`` with ``input_ids`` and
``return_logprob``); ``n`` samples as a batch of ``n`` seeded items; aborts by ``rid``; weight updates from
disk or by broadcast; sleep/wake by releasing and resuming memory; LoRA adapters loaded by path. The wire
format is `tandem.engines.inference.sglang.protocol` (SGLang 0.5.x field names). The same API is served by
the embedded engine (``tandem serve MODEL --api sglang``), which is how it is tested on CPU: no test here
has run real SGLang (docs/sglang.md says what that leaves unproven).

    engine = SGLangEngine(SGLangEngineConfig(model=ModelConfig(name="tiny-llama"), urls=["http://127.0.0.1:30000"]))

Requests run on an asyncio loop in a background thread (httpx), so ``generate`` from any thread and
``agenerate`` from any event loop share it; the servers do the batching.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import random
import shutil
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.core.protocols import (
    EngineAsleepError,
    EngineClosedError,
    EngineInfo,
    GenerationRequest,
    GenerationResult,
    NamedTensors,
)
from tandem.engines.inference.common import derive_seed, error_result
from tandem.engines.inference.sglang import protocol as P
from tandem.engines.inference.sglang.config import SGLangEngineConfig
from tandem.engines.inference.sglang.launch import launch_servers, stop_servers
from tandem.engines.inference.sglang.weights import BroadcastUpdate, DiskUpdate

__all__ = ["SGLangEngine", "SGLangServerError", "model_facts"]


@dataclass(kw_only=True, slots=True)
class _Plan:
    request: GenerationRequest
    prompt: list[int]
    url: str
    body: dict[str, Any]


class _GenerateFailed(Exception):
    """A ``/generate`` call that returned no outputs (the message is each request's error)."""


class SGLangServerError(RuntimeError):
    """A server that cannot be used: unreachable, of another version, or failing a control call."""


def model_facts(folder: str | Path) -> tuple[int, tuple[int, int] | None, tuple[int, ...]]:
    """``(vocab_size, (moe layers, top-k) or None, moe layer indices)`` of an HF model folder."""
    from transformers import AutoConfig

    from tandem.models.transformer import TransformerArgs

    args = TransformerArgs.from_hf_config(AutoConfig.from_pretrained(str(folder)))
    routing = (len(args.moe_layers), args.num_experts_per_tok) if args.moe_layers else None
    return args.vocab_size, routing, tuple(args.moe_layers)


class SGLangEngine:
    """The SGLang adapter (see the module docstring)."""

    def __init__(self, config: SGLangEngineConfig) -> None:
        import httpx

        from tandem.models.registry import resolve_model

        if config.model is None:
            raise ValueError("SGLangEngineConfig.model is None: name the model")
        self.config = config
        self.model_folder = resolve_model(config.model.name)
        self._vocab, self._routing, moe_layers = model_facts(self.model_folder)
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self._http = httpx.Client(timeout=config.control_timeout_s, headers=headers)
        self._procs: list = []
        if config.urls:
            self.urls = [u.rstrip("/") for u in config.urls]
        else:
            launched = launch_servers(config, self.model_folder, routed_experts=self._routing is not None)
            self._procs = [proc for proc, _ in launched]
            self.urls = [url for _, url in launched]
        self.workers = [u.rstrip("/") for u in config.worker_urls] or self.urls  # where control calls go
        try:
            infos = [self._server_info(u) for u in self.workers]
        except BaseException:
            self._http.close()
            self._stop_server()
            raise
        first = infos[0]
        self._version = P.parse_version(first.get("weight_version"))
        routed = self._routing is not None and all(i.get("enable_return_routed_experts") for i in infos)
        self._info = EngineInfo(
            name="sglang", version=str(first["version"]), dtype=config.model.dtype,
            deterministic=all(bool(i.get("enable_deterministic_inference")) for i in infos),
            moe_layers=moe_layers, max_context=config.max_model_len, vocab_size=self._vocab, can_sleep=True,
            routed_experts=routed, lora_adapters=config.lora_alpha is not None,
        )
        self._base_index = None  # the base checkpoint's weight names and shapes (adapter-only sync checks)
        self._lora: str | None = None  # the synced adapter every request uses unless it names another
        self._adapters: list[tuple[str, Path]] = []  # synced adapters still loaded (name, staged folder)
        self._seed_rng = random.Random(config.seed)
        self._lock = threading.Lock()
        self._inflight: dict[str, tuple[str, list[str]]] = {}  # request id -> (server url, sample rids)
        self._next_server = 0
        self._stats = {"requests": 0, "generated_tokens": 0}
        self._sleeping = self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tandem-sglang-http", daemon=True)
        self._thread.start()
        self._ahttp = asyncio.run_coroutine_threadsafe(self._async_client(headers), self._loop).result()
        post = self._post
        self._weights = (DiskUpdate(post, self.workers, self.model_folder, config.staging_dir)
                         if config.weight_transport == "disk" else
                         BroadcastUpdate(post, self.workers, address=config.group_address, backend=config.group_backend,
                                         timeout_s=config.control_timeout_s))

    async def _async_client(self, headers):
        import httpx

        limits = httpx.Limits(max_connections=4096, max_keepalive_connections=256)
        return httpx.AsyncClient(timeout=self.config.request_timeout_s, headers=headers, limits=limits)

    # -- the InferenceEngine protocol -------------------------------------------------------------------

    @property
    def info(self) -> EngineInfo:
        return self._info

    @property
    def weight_version(self) -> int:
        return self._version

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Blocking generation, results in request order; a bad request (or a failed server call) fails alone."""
        return [f.result() for f in self._submit_all(requests)]

    async def agenerate(self, request: GenerationRequest) -> GenerationResult:
        [future] = self._submit_all([request])
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            self.abort(request.request_id)
            raise

    def abort(self, request_id: str) -> None:
        """Abort every sample of a request: the server returns the partial tokens, finish reason ABORT.
        Aborts are re-sent until the request returns (one sent before the server registered it is lost)."""
        with self._lock:
            entry = self._inflight.get(request_id)
        if entry is not None and not self._closed:
            asyncio.run_coroutine_threadsafe(self._abort_until_done(request_id, *entry), self._loop)

    def abort_all(self) -> None:
        with self._lock:
            ids = list(self._inflight)
        for request_id in ids:
            self.abort(request_id)

    def update_weights(self, named_tensors: NamedTensors, version: int) -> None:
        """Send HF-named tensors to every server (``weight_transport``); afterwards ``weight_version == version``.
        A server that refuses the update (unknown name, wrong shape) raises ValueError with its reason."""
        with self._paused():
            self._weights.send(list(named_tensors), int(version))
        self._version = int(version)

    def sleep(self) -> None:
        """``/release_memory_occupation`` on every server (KV cache and weights); requests must be finished."""
        self._check_open()
        with self._lock:
            busy = len(self._inflight)
        if busy:
            raise EngineAsleepError(f"sleep() with {busy} request(s) in flight: finish or abort them first")
        for url in self.workers:
            self._post(url, "/release_memory_occupation", {}, error=EngineAsleepError)
        self._sleeping = True

    def wake_up(self) -> None:
        self._check_open()
        for url in self.workers:
            self._post(url, "/resume_memory_occupation", {})
        self._sleeping = False

    def health(self) -> dict[str, Any]:
        """Status, version and counters. Where a server reports its engine's counters (the embedded engine's
        ``internal_states``) they are summed; otherwise ``running`` / ``generated_tokens`` are this adapter's."""
        status = "closed" if self._closed else ("sleeping" if self._sleeping else "ok")
        with self._lock:
            out: dict[str, Any] = {"status": status, "weight_version": self._version, "running": len(self._inflight),
                                   "paused": False, **self._stats, "servers": {}}
        counted = {"running": 0, "generated_tokens": 0}
        reported = 0
        for url in self.workers:
            try:
                state = (self._get(url, "/server_info").get("internal_states") or [{}])[0]
                out["servers"][url] = "ok"
            except SGLangServerError as e:
                out["servers"][url] = str(e)
                out["status"] = "error" if status == "ok" else status
                continue
            if isinstance(state, dict) and state.get("paused"):
                out["paused"] = True  # a server holds its requests in place (/pause_generation in_place)
            if isinstance(state, dict) and all(isinstance(state.get(k), int) for k in counted):
                reported += 1
                for k in counted:
                    counted[k] += state[k]
        if reported == len(self.workers):
            out.update(counted)
        return out

    def close(self) -> None:
        if self._closed:
            return
        self.abort_all()
        self._closed = True
        self._weights.close()
        for _, folder in self._adapters:  # staged adapter folders of adapter-only sync
            shutil.rmtree(folder, ignore_errors=True)
        asyncio.run_coroutine_threadsafe(self._ahttp.aclose(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._http.close()
        self._stop_server()

    def __enter__(self) -> SGLangEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- SGLang's other controls ------------------------------------------------------------------------

    def pause_generation(self, mode: str = "abort") -> None:
        """``/pause_generation`` on every server (``abort``: running requests return partial; new ones wait)."""
        for url in self.workers:
            self._post(url, "/pause_generation", {"mode": mode})

    def continue_generation(self) -> None:
        for url in self.workers:
            self._post(url, "/continue_generation", {})

    @contextlib.contextmanager
    def _paused(self) -> Iterator[None]:
        """Pause every server (``pause_on_update``) around a weight update; continue even if it fails."""
        mode = self.config.pause_on_update
        if mode == "none":
            yield
            return
        self.pause_generation(mode)
        try:
            yield
        finally:
            self.continue_generation()

    def flush_cache(self) -> None:
        for url in self.workers:
            self._post(url, "/flush_cache", {})

    def load_lora_adapter_from_path(self, name: str, folder: str) -> None:
        """Serve the peft adapter folder under ``name`` on every server; requests pick it with ``lora=name``."""
        for url in self.workers:
            self._post(url, "/load_lora_adapter", {"lora_name": name, "lora_path": str(folder)}, error=ValueError)

    def load_lora_adapter(self, named_tensors, version: int) -> None:
        """`LoRAEngine` (adapter-only sync): the trainer's adapter tensors (peft names) become a peft folder every
        server loads as ``tandem-v<version>``; later requests use it unless they name another (``lora="base"``:
        the base model), and the servers' weight version becomes ``version`` (``/update_weight_version``).
        The previous adapter stays loaded for requests still in flight; older ones are unloaded."""
        from tandem.engines.inference.common import CheckpointIndex, lora_adapter_folder, staging_root

        if self.config.lora_alpha is None:
            raise ValueError("load_lora_adapter: SGLangEngineConfig.lora_alpha is not set (adapter-only sync is "
                             "off); set it to the trainer's LoRA alpha, or send merged weights (sync.lora_mode: merged)")
        self._check_open()
        if self._base_index is None:
            self._base_index = CheckpointIndex(self.model_folder, tied_embeddings=True)
        folder = lora_adapter_folder(list(named_tensors), staging_root(self.config.staging_dir), self._base_index,
                                     alpha=self.config.lora_alpha, max_rank=self.config.lora_max_rank)
        name = f"tandem-v{int(version)}"
        try:
            with self._paused():
                self.load_lora_adapter_from_path(name, str(folder))
                for url in self.workers:
                    self._post(url, "/update_weight_version", {"new_version": str(int(version)),
                                                               "abort_all_requests": False})
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        self._adapters.append((name, folder))
        self._lora, self._version = name, int(version)
        while len(self._adapters) > 2:
            old, old_folder = self._adapters.pop(0)
            for url in self.workers:
                self._post(url, "/unload_lora_adapter", {"lora_name": old})
            shutil.rmtree(old_folder, ignore_errors=True)

    # -- requests ----------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("the SGLang engine is closed")

    def _plan(self, request: GenerationRequest) -> _Plan | GenerationResult:
        """The checked request with its server and body (registered in flight), or its error result."""
        if not isinstance(request, GenerationRequest):
            raise TypeError(f"requests must be GenerationRequest objects, got {type(request).__name__}")
        self._check_open()
        if self._sleeping:
            raise EngineAsleepError("the engine is asleep: call wake_up() before generating")
        try:
            prompt, sampling = request.check(vocab_size=self._vocab, max_model_len=self.config.max_model_len,
                                             routed_experts=self._info.routed_experts)
        except ValueError as e:
            return error_result(request, str(e))
        rids = P.sample_ids(request.request_id, sampling.n)
        with self._lock:
            if request.request_id in self._inflight:
                return error_result(request, f"request_id {request.request_id!r} is already in flight")
            url = self.urls[self._next_server % len(self.urls)]
            self._next_server += 1
            self._inflight[request.request_id] = (url, rids)
            self._stats["requests"] += 1
        base = sampling.seed if sampling.seed is not None else self._seed_rng.getrandbits(63)
        body = P.generate_body(prompt, sampling, rids=rids, seeds=[derive_seed(base, i) for i in range(sampling.n)],
                               max_new_tokens=min(sampling.max_new_tokens, self.config.max_model_len - len(prompt)),
                               lora=self._lora if request.lora is None else
                               (None if request.lora == "base" else request.lora))
        return _Plan(request=request, prompt=prompt, url=url, body=body)

    def _submit_group(self, plans: list[_Plan]) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(self._run(plans), self._loop)

    def _submit_all(self, requests: Sequence[GenerationRequest]) -> list[concurrent.futures.Future]:
        """One ``/generate`` per server (and routed-experts flag) for all of ``requests``: they arrive together,
        so the server batches them as one (the same composition gives the same numerics every time)."""
        out: list[Any] = [self._plan(r) for r in requests]
        groups: dict[tuple[str, bool], list[int]] = {}
        for i, plan in enumerate(out):
            if isinstance(plan, _Plan):
                groups.setdefault((plan.url, bool(plan.body.get("return_routed_experts"))), []).append(i)
        futures: list[concurrent.futures.Future] = []
        for index in range(len(out)):
            f: concurrent.futures.Future = concurrent.futures.Future()
            if isinstance(out[index], GenerationResult):
                f.set_result(out[index])
            futures.append(f)
        for members in groups.values():
            group = self._submit_group([out[i] for i in members])

            def fan_out(g, members=members):
                try:
                    for i, result in zip(members, g.result(), strict=True):
                        if not futures[i].done():  # a cancelled agenerate
                            futures[i].set_result(result)
                except BaseException as e:  # noqa: BLE001 - handed to every waiter
                    for i in members:
                        if not futures[i].done():
                            futures[i].set_exception(e)

            group.add_done_callback(fan_out)
        return futures

    async def _run(self, plans: list[_Plan]) -> list[GenerationResult]:
        url = plans[0].url
        body = P.merge_bodies([p.body for p in plans])
        try:
            if self.config.worker_urls:  # sglang-router takes one prompt and one sampling dict per request
                parts = await asyncio.gather(*(self._post_generate(url, one) for one in P.split_body(body)))
                outputs = [o for part in parts for o in part]
            else:
                outputs = await self._post_generate(url, body)
            if len(outputs) != len(body["rid"]):
                raise _GenerateFailed(f"SGLang server {url}: {len(outputs)} outputs for {len(body['rid'])} samples")
        except _GenerateFailed as e:
            return [error_result(p.request, str(e)) for p in plans]
        finally:
            with self._lock:
                for p in plans:
                    self._inflight.pop(p.request.request_id, None)
        results, offset = [], 0
        routing = self._routing if body.get("return_routed_experts") else None
        for p in plans:
            n = len(p.body["rid"])
            try:
                completions = [P.completion_from_output(o, prompt_len=len(p.prompt), routing=routing)
                               for o in outputs[offset: offset + n]]
            except (ValueError, TypeError, KeyError, IndexError) as e:
                results.append(error_result(p.request, f"SGLang server {url}: unreadable /generate output: {e}"))
            else:
                results.append(GenerationResult(request_id=p.request.request_id, prompt_token_ids=p.prompt,
                                                completions=completions))
                with self._lock:
                    self._stats["generated_tokens"] += sum(len(c.token_ids) for c in completions)
            offset += n
        return results

    async def _post_generate(self, url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
        """The outputs of one ``/generate`` call (a list, one per item); `_GenerateFailed` with the reason."""
        import httpx

        try:
            response = await self._ahttp.post(url + "/generate", json=body)
        except httpx.TimeoutException:
            raise _GenerateFailed(f"SGLang server {url}: /generate timed out after {self.config.request_timeout_s} s "
                                  "(request_timeout_s)") from None
        except httpx.HTTPError as e:
            raise _GenerateFailed(f"SGLang server {url} unreachable: {type(e).__name__}: {e}") from None
        if response.status_code != 200:
            raise _GenerateFailed(f"SGLang server {url} answered {response.status_code} to /generate: "
                                  f"{P.error_message(_json(response), response.text)}")
        outputs = _json(response)
        outputs = [outputs] if isinstance(outputs, dict) else outputs
        if not isinstance(outputs, list):
            raise _GenerateFailed(f"SGLang server {url}: unreadable /generate response: {response.text[:200]}")
        return outputs

    async def _abort_until_done(self, request_id: str, url: str, rids: list[str]) -> None:
        deadline = time.monotonic() + self.config.control_timeout_s
        targets = [url] if url in self.workers else self.workers  # behind a router: wherever it went
        while time.monotonic() < deadline:
            for rid, target in ((r, t) for r in rids for t in targets):
                try:
                    await self._ahttp.post(target + "/abort_request", json={"rid": rid}, timeout=10)
                except Exception:  # noqa: BLE001, S110 - the request's own call reports a dead server
                    pass
            await asyncio.sleep(0.05)
            with self._lock:
                if request_id not in self._inflight:
                    return

    # -- control calls -----------------------------------------------------------------------------------

    def _server_info(self, url: str) -> dict[str, Any]:
        info = self._get(url, "/server_info")
        problem = P.version_problem(info.get("version"), self.config.sglang_version)
        if problem:
            raise SGLangServerError(f"SGLang server {url} refused: {problem}")
        context = info.get("context_length")
        if isinstance(context, int) and context < self.config.max_model_len:
            raise SGLangServerError(f"SGLang server {url} serves a context of {context} tokens; max_model_len="
                                    f"{self.config.max_model_len} needs at least that many")
        return info

    def _get(self, url: str, path: str) -> dict[str, Any]:
        import httpx

        try:
            response = self._http.get(url + path)
        except httpx.HTTPError as e:
            raise SGLangServerError(f"SGLang server {url} unreachable ({path}): {type(e).__name__}: {e}") from None
        if response.status_code != 200:
            raise SGLangServerError(f"SGLang server {url} answered {response.status_code} to {path}: "
                                    f"{P.error_message(_json(response), response.text)}")
        return _json(response) or {}

    def _post(self, url: str, path: str, body: dict[str, Any], *, error: type[Exception] = ValueError) -> dict:
        """POST a control call; a 4xx (or ``success: false``) raises ``error`` with the server's message, a
        transport failure or 5xx `SGLangServerError`."""
        import httpx

        try:
            response = self._http.post(url + path, json=body)
        except httpx.HTTPError as e:
            raise SGLangServerError(f"SGLang server {url} unreachable ({path}): {type(e).__name__}: {e}") from None
        data = _json(response)
        message = P.error_message(data, response.text)
        if response.status_code >= 500 or not 200 <= response.status_code < 500:
            raise SGLangServerError(f"SGLang server {url} answered {response.status_code} to {path}: {message}")
        if response.status_code >= 400 or (isinstance(data, dict) and data.get("success") is False):
            raise error(f"SGLang server {url} refused {path}: {message}")
        return data if isinstance(data, dict) else {}

    def _stop_server(self) -> None:
        procs, self._procs = self._procs, []
        stop_servers(procs)


def _json(response) -> Any:
    try:
        return response.json()
    except ValueError:
        return None
