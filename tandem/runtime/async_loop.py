"""Fully asynchronous mode: a producer keeps generating while the trainer trains.

A producer thread runs an asyncio loop that keeps ``prompts_per_step`` groups in flight on the
inference engine (``agenerate``: they share its continuous batch), scores each finished group and
puts it into a bounded queue of ``queue_groups`` groups; when the queue is full the producer waits
(backpressure). The trainer takes ``prompts_per_step`` groups per step. A group whose oldest token is
more than ``max_staleness`` weight versions behind the trainer is dropped (``stale_policy: drop``) or
its prompt is generated again (``regenerate``). Weight updates reach the engine between two decode
steps: rollouts in flight continue with the new weights (partial rollouts), or with
``partial_rollouts: false`` they are aborted and regenerated from scratch.

The data order in this mode depends on timing, so a resumed run does not repeat an uninterrupted one
bit for bit (sync mode does).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING

from tandem.core.filters import filter_samples
from tandem.core.protocols import GenerationRequest
from tandem.core.sample import Sample, SampleStatus
from tandem.rollout.generate import completion_to_sample, request_seed
from tandem.runtime.metrics import rollout_metrics, staleness_metrics

if TYPE_CHECKING:
    from tandem.runtime.loop import Run

__all__ = ["train_fully_async"]

log = logging.getLogger(__name__)
_STOP = object()


class _Producer(threading.Thread):
    def __init__(self, run: Run, out: queue.Queue) -> None:
        super().__init__(name="tandem-producer", daemon=True)
        self.run_, self.out = run, out
        self.stop_event = threading.Event()
        self.retry: queue.SimpleQueue = queue.SimpleQueue()  # prompts to generate again
        self.error: BaseException | None = None
        self.groups_made = 0
        self.generated_tokens = 0
        self.lock = threading.Lock()

    def run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:  # noqa: BLE001 - surfaced to the trainer thread
            self.error = e
            # a blocking put into a full queue would keep this thread (and the trainer's join) waiting
            # if the trainer stops first, e.g. because it found the engine process dead while syncing
            while not self.stop_event.is_set():
                try:
                    self.out.put(_STOP, timeout=0.1)
                    return
                except queue.Full:
                    pass

    async def _main(self) -> None:
        cfg = self.run_.cfg
        in_flight = max(1, cfg.rollout.prompts_per_step)
        tasks: set[asyncio.Task] = set()
        while not self.stop_event.is_set():
            while len(tasks) < in_flight and not self.stop_event.is_set():
                tasks.add(asyncio.create_task(self._one_group()))
            done, tasks = await asyncio.wait(tasks, timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
            # one error is raised; reading them all keeps asyncio from logging the others (a dead engine
            # fails every group in flight at once)
            failed = [t.exception() for t in done if not t.cancelled() and t.exception() is not None]
            if failed:
                raise failed[0]
        for t in tasks:
            t.cancel()

    async def _one_group(self) -> None:
        run, cfg = self.run_, self.run_.cfg
        try:
            record = self.retry.get_nowait()
        except queue.Empty:
            record = run.data.next_prompts(1)[0]
        with self.lock:
            group_index = self.groups_made
            self.groups_made += 1
        eos = run.tokenizer.eos_token_id
        request = GenerationRequest(
            prompt_token_ids=list(record.prompt_token_ids),
            sampling=cfg.rollout.sampling.params(n=cfg.rollout.n_samples_per_prompt,
                                                 seed=request_seed(cfg.run.seed, group_index, record.index),
                                                 eos_token_id=eos),
        )
        result = await run.engine.agenerate(request)
        samples = [completion_to_sample(record, c, tokenizer=run.tokenizer, group_index=group_index, index=i)
                   for i, c in enumerate(result.completions)]
        if any(s.status == SampleStatus.ABORTED for s in samples):  # aborted by a weight update
            self.retry.put(record)
            return
        scorable = [s for s in samples if s.status != SampleStatus.FAILED]
        if scorable:
            await asyncio.get_running_loop().run_in_executor(None, run.rewards.score, scorable)
        self.generated_tokens += sum(s.response_length for s in samples)
        while not self.stop_event.is_set():  # backpressure: wait for room in the queue
            try:
                self.out.put((record, samples), timeout=0.2)
                return
            except queue.Full:
                await asyncio.sleep(0.05)


def train_fully_async(run: Run) -> None:
    cfg = run.cfg
    groups: queue.Queue = queue.Queue(maxsize=cfg.runtime.queue_groups)
    producer = _Producer(run, groups)
    producer.start()
    try:
        for step in range(run.step, cfg.run.steps):
            t0 = time.perf_counter()
            run.progress.phase(step, "wait for rollouts")
            batch: list[Sample] = []
            every: list[Sample] = []
            dropped_stale = 0
            tokens_before = producer.generated_tokens
            while len({s.group_index for s in batch}) < cfg.rollout.prompts_per_step:
                item = groups.get()
                if item is _STOP:
                    raise RuntimeError(f"the rollout producer failed: {producer.error}") from producer.error
                record, samples = item
                lag = run.version - min((min(s.weight_versions) for s in samples if s.weight_versions), default=run.version)
                if lag > cfg.runtime.max_staleness:
                    dropped_stale += 1
                    if cfg.runtime.stale_policy == "regenerate":
                        producer.retry.put(record)
                    continue
                every += samples
                kept, _dropped, _fm = filter_samples(samples, cfg.algorithm.filters)
                batch += kept
            wait_s = time.perf_counter() - t0
            metrics = rollout_metrics(every, seconds=wait_s)
            metrics |= staleness_metrics(batch, run.version)
            metrics |= {"async/queue_depth": float(groups.qsize()), "async/dropped_stale": float(dropped_stale),
                        "time/wait_rollout_s": wait_s,
                        "async/producer_tokens": float(producer.generated_tokens - tokens_before)}
            metrics |= run.train_on(step, batch)
            metrics |= run.sync_weights()
            if not cfg.runtime.partial_rollouts:
                run.engine.abort_all()  # in-flight groups are regenerated with the new weights
            run._finish_step(step, metrics, batch, t0)
    finally:
        producer.stop_event.set()
        run.engine.abort_all()
        producer.join(timeout=30)
