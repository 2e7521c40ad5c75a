"""The two ways the adapter runs vLLM: its engine core in this process, or vLLM's async engine.

Both take vLLM requests of one sample each and call ``on_output(output)`` with every delta
``CompletionOutput`` (``None`` when the request was aborted without a final output), from whichever
thread processes vLLM's outputs. Weight reloads and LoRA loads go through vLLM's public
``collective_rpc`` (the worker's ``reload_weights``) and ``add_lora``.

* `InprocessBackend`: ``vllm.LLMEngine`` with the engine core in this process. No thread of its own:
  whoever waits for results steps the engine (``drive``), like the embedded torch engine. A step lock
  serialises steps; reloads take it, so they land between two steps. Tensors reach the worker as an
  iterator, without a copy.
* `AsyncBackend`: ``vllm.AsyncLLM`` (engine core in a child process) on an event loop in a background
  thread. A reload pauses the scheduler (in-flight requests are kept), reloads from a folder, labels
  the new weight version in vLLM and resumes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

__all__ = ["AsyncBackend", "InprocessBackend"]

log = logging.getLogger(__name__)

OnOutput = Callable[[Any], None]

# vLLM keeps its parallel state (process groups) per process: a second in-process engine would share
# it, and closing either would break the other.
_inprocess_live = threading.Lock()


def _prompt(ids: list[int]) -> Any:
    from vllm.inputs import TokensPrompt

    return TokensPrompt(prompt_token_ids=ids)


class InprocessBackend:
    """``vllm.LLMEngine`` in this process, stepped by the threads (or coroutines) that wait on it."""

    def __init__(self, engine_kwargs: dict[str, Any]) -> None:
        if not _inprocess_live.acquire(blocking=False):
            raise RuntimeError(
                "another in-process vLLM engine is open in this process (vLLM's parallel state is per "
                "process): close it first, or use backend='async' (engine core in its own process)"
            )
        try:
            # vLLM reads this when the engine is built: the engine core then lives in this process
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            from vllm import EngineArgs, LLMEngine

            self.llm = LLMEngine.from_engine_args(EngineArgs(**engine_kwargs))
        except BaseException:
            _inprocess_live.release()
            raise
        self.llm.set_weight_version("0")
        self._callbacks: dict[str, OnOutput] = {}
        self._lock = threading.Lock()  # guards _callbacks and _priority
        self._step_lock = threading.RLock()
        self._priority = 0  # callers waiting for the step lock to change the engine: drivers yield to them
        self.last_error: str | None = None
        self._released = False

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the step lock ahead of drivers (a driver would otherwise re-take it step after step)."""
        with self._lock:
            self._priority += 1
        try:
            self._step_lock.acquire()
        finally:
            with self._lock:
                self._priority -= 1
        try:
            yield
        finally:
            self._step_lock.release()

    def add(self, vllm_id: str, prompt: list[int], params: Any, lora: Any, on_output: OnOutput) -> None:
        with self.exclusive():
            self.llm.add_request(vllm_id, _prompt(prompt), params, lora_request=lora)
            with self._lock:
                self._callbacks[vllm_id] = on_output

    def abort(self, vllm_ids: list[str]) -> None:
        with self.exclusive():
            with self._lock:
                live = [i for i in vllm_ids if i in self._callbacks]
                callbacks = [self._callbacks.pop(i) for i in live]
            if live:
                self.llm.abort_request(live)
            for cb in callbacks:
                cb(None)  # vLLM emits nothing for a request aborted in process: finish it here

    def drive(self, *, blocking: bool) -> bool:
        """Run one engine step in the calling thread if the step lock is free; whether one ran."""
        if self._priority or not self._step_lock.acquire(blocking=blocking):
            return False
        try:
            with self._lock:
                busy = bool(self._callbacks)
            if not busy:
                return False
            try:
                outputs = self.llm.step()
            except Exception as e:  # noqa: BLE001 - the requests fail, the caller sees their error
                self._fail_all(f"vLLM engine step failed: {type(e).__name__}: {e}")
                return True
            for out in outputs:
                with self._lock:
                    cb = self._callbacks.get(out.request_id)
                    if cb is not None and out.finished:
                        del self._callbacks[out.request_id]
                if cb is not None:
                    cb(out.outputs[0])
            return True
        finally:
            self._step_lock.release()

    def _fail_all(self, message: str) -> None:
        self.last_error = message
        log.error(message)
        with self._lock:
            callbacks, self._callbacks = dict(self._callbacks), {}
        with contextlib.suppress(Exception):
            self.llm.abort_request(list(callbacks))
        for cb in callbacks.values():
            cb(RuntimeError(message))

    def wait(self, futures: list[concurrent.futures.Future]) -> None:
        while not all(f.done() for f in futures):
            if not self.drive(blocking=True):  # another thread's step is finishing our requests
                concurrent.futures.wait(futures, timeout=0.005, return_when=concurrent.futures.FIRST_COMPLETED)

    async def await_future(self, future: concurrent.futures.Future) -> None:
        await asyncio.sleep(0)  # let coroutines started together submit before the first step
        while not future.done():
            stepped = self.drive(blocking=False)
            await asyncio.sleep(0 if stepped else 0.001)

    def in_flight(self) -> int:
        with self._lock:
            return len(self._callbacks)

    def reload(self, weights: Iterable[tuple[str, torch.Tensor]] | str, version: int) -> None:
        """Reload every weight (tensors, or a safetensors folder) between two steps; label ``version``."""
        kwargs = {"weights_path": weights} if isinstance(weights, str) else {"weights_iterator": iter(weights)}
        with self.exclusive():
            self.llm.collective_rpc("reload_weights", kwargs=kwargs)
            # Cached prefixes hold keys/values of the old weights: drop them (running requests are
            # preempted and recompute their context with the new weights).
            self.llm.reset_prefix_cache(reset_running_requests=True)
            self.llm.set_weight_version(str(version))

    def add_lora(self, lora: Any, version: int) -> None:
        with self.exclusive():
            if not self.llm.add_lora(lora):
                raise RuntimeError(f"vLLM did not load the LoRA adapter {lora.lora_name!r}")
            self.llm.reset_prefix_cache(reset_running_requests=True)
            self.llm.set_weight_version(str(version))

    def sleep(self, level: int) -> None:
        with self.exclusive():
            self.llm.sleep(level=level)

    def wake_up(self) -> None:
        with self.exclusive():
            self.llm.wake_up()

    def shutdown(self) -> None:
        with self.exclusive():
            with contextlib.suppress(Exception):
                self.llm.abort_request(list(self._callbacks))
            self._callbacks.clear()
            engine_core = getattr(self.llm, "engine_core", None)
            with contextlib.suppress(Exception):
                engine_core.shutdown()
        if not self._released:
            self._released = True
            _inprocess_live.release()


class AsyncBackend:
    """``vllm.AsyncLLM`` on an event loop in a background thread; every caller submits to that loop."""

    def __init__(self, engine_kwargs: dict[str, Any], *, start_timeout_s: float = 900.0) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="tandem-vllm-loop", daemon=True)
        self._thread.start()
        self._tasks: dict[str, asyncio.Task] = {}
        self.last_error: str | None = None
        try:
            self.llm = self._run(self._start(engine_kwargs), timeout=start_timeout_s)
        except BaseException:
            self._stop_loop()
            raise

    @staticmethod
    async def _start(engine_kwargs: dict[str, Any]) -> Any:
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_kwargs))
        await llm.update_weight_version("0")
        return llm

    def _run(self, coro: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def add(self, vllm_id: str, prompt: list[int], params: Any, lora: Any, on_output: OnOutput) -> None:
        def start() -> None:
            task = self.loop.create_task(self._consume(vllm_id, prompt, params, lora, on_output))
            self._tasks[vllm_id] = task
            task.add_done_callback(lambda t: self._done(vllm_id, t, on_output))

        self.loop.call_soon_threadsafe(start)

    async def _consume(self, vllm_id: str, prompt: list[int], params: Any, lora: Any, on_output: OnOutput) -> bool:
        """Feed every delta output to ``on_output``; whether the final one came."""
        async for out in self.llm.generate(_prompt(prompt), params, vllm_id, lora_request=lora):
            on_output(out.outputs[0])
            if out.finished:
                return True
        return False

    def _done(self, vllm_id: str, task: asyncio.Task, on_output: OnOutput) -> None:
        self._tasks.pop(vllm_id, None)
        if task.cancelled():  # aborted (cancelling generate() aborts the request in vLLM)
            on_output(None)
        elif task.exception() is not None:  # this request fails; the engine keeps serving
            e = task.exception()
            self.last_error = f"vLLM request failed: {type(e).__name__}: {e}"
            on_output(RuntimeError(self.last_error))
        elif not task.result():
            on_output(None)

    def abort(self, vllm_ids: list[str]) -> None:
        def cancel() -> None:
            for vllm_id in vllm_ids:
                task = self._tasks.get(vllm_id)
                if task is not None:
                    task.cancel()

        self.loop.call_soon_threadsafe(cancel)

    def wait(self, futures: list[concurrent.futures.Future]) -> None:
        concurrent.futures.wait(futures)

    async def await_future(self, future: concurrent.futures.Future) -> None:
        await asyncio.wrap_future(future)

    def in_flight(self) -> int:
        return len(self._tasks)

    def reload(self, weights: Iterable[tuple[str, torch.Tensor]] | str, version: int) -> None:
        if not isinstance(weights, str):
            raise TypeError("the async backend reloads from a folder (the engine stages tensors first)")

        async def reload() -> None:
            # "keep": in-flight requests wait, then continue on the new weights; clear_cache drops
            # prefix-cache blocks computed with the old ones.
            await self.llm.pause_generation(mode="keep", clear_cache=True)
            try:
                await self.llm.collective_rpc("reload_weights", kwargs={"weights_path": weights})
                await self.llm.update_weight_version(str(version))
            finally:
                await self.llm.resume_generation()

        self._run(reload())

    def add_lora(self, lora: Any, version: int) -> None:
        async def add() -> None:
            if not await self.llm.add_lora(lora):
                raise RuntimeError(f"vLLM did not load the LoRA adapter {lora.lora_name!r}")
            await self.llm.reset_prefix_cache()
            await self.llm.update_weight_version(str(version))

        self._run(add())

    def sleep(self, level: int) -> None:
        self._run(self.llm.sleep(level))

    def wake_up(self) -> None:
        self._run(self.llm.wake_up())

    def shutdown(self) -> None:
        async def stop() -> None:
            for task in list(self._tasks.values()):
                task.cancel()
            self.llm.shutdown()

        with contextlib.suppress(Exception):
            self._run(stop(), timeout=60)
        self._stop_loop()
        # AsyncLLM.__del__ shuts down again; let it run now rather than at interpreter exit (it fails there)
        self.llm = None

    def _stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)
