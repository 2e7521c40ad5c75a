"""Fully asynchronous mode: a producer keeps generating while the trainer trains.

A producer thread runs an asyncio loop that keeps ``prompts_per_step`` groups in flight through the
run's generate function (any of them: single-turn, multi-turn, agentic, a user's; their engine calls
share the engine's continuous batch), recomputes log-probs if asked, scores each finished group and
puts it into a bounded queue of ``queue_groups`` groups; when the queue is full the producer waits
(backpressure). The trainer takes groups until ``prompts_per_step`` of them survive the filters, or
``max_rounds x prompts_per_step`` were taken (as the synchronous modes' rounds). A group whose oldest
token is more than ``max_staleness`` weight versions behind the trainer is dropped (``stale_policy:
drop``) or its prompt is generated again (``regenerate``). Weight updates reach the engine between two
decode steps: rollouts in flight continue with the new weights (partial rollouts), or with
``partial_rollouts: false`` they are aborted and their groups regenerated from scratch (a group
holding a sample the engine aborted, ``status_reason: engine_abort``). ``rollout.dump`` writes every
group a step consumed.

A checkpoint holds the finished groups waiting in the queue (samples, weight versions, metrics) and
requeues the prompts of the groups still generating (`tandem.runtime.pending`): a resumed run loses and
repeats no prompt, and trains on the queued groups as the uninterrupted run would have. The data order
in this mode depends on timing, so a resumed run still does not repeat an uninterrupted one bit for bit
(sync and one-step-off do).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING

from tandem.core.filters import filter_samples
from tandem.core.sample import Sample
from tandem.rollout.data import PromptRecord
from tandem.rollout.functions import RolloutContext
from tandem.rollout.generate import request_seed
from tandem.runtime.metrics import rollout_metrics, staleness_metrics
from tandem.runtime.pending import decode_groups, encode_groups
from tandem.runtime.rollouts import Rollouts, add_metrics, episode_metrics

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
        # under `lock`: prompts to generate again, the groups generating, what the data source handed out
        self.lock = threading.Lock()
        self.retry: collections.deque[PromptRecord] = collections.deque()
        self.in_flight: dict[int, PromptRecord] = {}  # group index -> its prompt
        self.error: BaseException | None = None
        self.groups_made = 0
        self.generated_tokens = 0
        self.regenerated = 0  # groups generated again after an engine abort

    def requeue(self, record: PromptRecord) -> None:
        """Generate ``record``'s group again (a stale group, ``stale_policy: regenerate``)."""
        with self.lock:
            self.retry.append(record)

    def snapshot(self) -> tuple[dict, dict]:
        """``(data state, rollouts)`` for a checkpoint: the data position with the prompts of the groups
        generating (and waiting to be generated again) requeued, and the finished groups in the queue."""
        with self.lock:
            with self.out.mutex:
                queued = [item for item in self.out.queue if item is not _STOP]
            requeue = [*self.retry, *(self.in_flight[k] for k in sorted(self.in_flight))]
            data = self.run_.data.state_dict(requeue=requeue)
            made = self.groups_made
        places = self.run_.data.positions(record for record, _, _ in queued)
        groups = encode_groups((p, samples, metrics) for p, (_, samples, metrics) in zip(places, queued, strict=True))
        return data, {"mode": "fully_async", "groups_made": made, "queued": groups}

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
        in_flight = max(1, self.run_.cfg.rollout.prompts_per_step)
        tasks: set[asyncio.Task] = set()
        async with self.run_.rollouts.context(stopping=self.stop_event.is_set) as ctx:
            try:
                while not self.stop_event.is_set():
                    while len(tasks) < in_flight and not self.stop_event.is_set():
                        tasks.add(asyncio.create_task(self._one_group(ctx)))
                    if not tasks:
                        break
                    done, tasks = await asyncio.wait(tasks, timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
                    # one error is raised; reading them all keeps asyncio from logging the others (a dead
                    # engine fails every group in flight at once)
                    failed = [t.exception() for t in done if not t.cancelled() and t.exception() is not None]
                    if failed:
                        raise failed[0]
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    async def _one_group(self, ctx: RolloutContext) -> None:
        run = self.run_
        with self.lock:  # taking a prompt and recording it as generating is one step for `snapshot`
            record = self.retry.popleft() if self.retry else run.data.next_prompts(1)[0]
            group_index = self.groups_made
            self.groups_made += 1
            self.in_flight[group_index] = record
        seed = request_seed(run.cfg.run.seed, group_index, record.index)
        samples, metrics = await run.rollouts.group(ctx, record, group_index=group_index, seed=seed)
        if any(s.metadata.get("status_reason") == "engine_abort" for s in samples):  # a weight update aborted it
            with self.lock:
                self.regenerated += 1
                del self.in_flight[group_index]
                self.retry.append(record)
            return
        self.generated_tokens += sum(s.response_length for s in samples)
        while not self.stop_event.is_set():  # backpressure: wait for room in the queue
            with self.lock:
                try:
                    self.out.put_nowait((record, samples, metrics))
                    del self.in_flight[group_index]
                    return
                except queue.Full:
                    pass
            await asyncio.sleep(0.05)


def _next_group(groups: queue.Queue, run: Run):
    """The next finished group; waits in slices so the watchdog or a stop signal can end the wait (groups
    that never come, e.g. from a generate function that hangs, would otherwise be waited for forever)."""
    while True:
        try:
            return groups.get(timeout=0.2)
        except queue.Empty:
            run.poll_stop()


def train_fully_async(run: Run) -> None:
    cfg = run.cfg
    groups: queue.Queue = queue.Queue(maxsize=cfg.runtime.queue_groups)
    producer = _Producer(run, groups)
    saved = run.take_resumed_rollouts("fully_async")
    if saved is not None:  # the checkpoint's queue; the prompts that were generating are requeued in the data
        producer.groups_made = int(saved["groups_made"])
        for place, samples, metrics in decode_groups(saved["queued"]):
            record = run.data.records[place]
            try:
                groups.put_nowait((record, samples, metrics))
            except queue.Full:  # a smaller runtime.queue_groups than the saved run's
                run.data.requeue([record])
        log.info("resumed with %d queued groups from the checkpoint", groups.qsize())
    run._snapshot_rollouts = producer.snapshot
    producer.start()
    budget = cfg.rollout.max_rounds * cfg.rollout.prompts_per_step  # groups one step may consume
    try:
        for step in range(run.step, cfg.run.steps):
            t0 = time.perf_counter()
            evaluated = run.eval_at(step)  # beside the producer: eval requests join the engine's batch
            run.phase(step, "wait for rollouts")
            batch: list[Sample] = []
            every: list[Sample] = []
            extra: dict[str, float] = {}
            dropped_stale = taken = 0
            tokens_before, regenerated_before = producer.generated_tokens, producer.regenerated
            while len({s.group_index for s in batch}) < cfg.rollout.prompts_per_step and taken < budget:
                item = _next_group(groups, run)
                if item is _STOP:
                    raise RuntimeError(f"the rollout producer failed: {producer.error}") from producer.error
                record, samples, group_metrics = item
                lag = run.version - min((min(s.weight_versions) for s in samples if s.weight_versions),
                                        default=run.version)
                if lag > cfg.runtime.max_staleness:
                    dropped_stale += 1
                    if cfg.runtime.stale_policy == "regenerate":
                        producer.requeue(record)
                    continue
                taken += 1
                every += samples
                add_metrics(extra, group_metrics)
                kept, _dropped, fm = filter_samples(samples, cfg.algorithm.filters)
                add_metrics(extra, fm)
                batch += kept
            for i, s in enumerate(batch):  # the step's samples in the order they are trained on
                s.index = i
            wait_s = time.perf_counter() - t0
            metrics = rollout_metrics(every, seconds=wait_s) | episode_metrics(every) | Rollouts.finish_metrics(extra)
            metrics |= run.skips.note_samples(step, every)
            metrics |= staleness_metrics(batch, run.version)
            metrics |= {"async/queue_depth": float(groups.qsize()), "async/dropped_stale": float(dropped_stale),
                        "time/wait_rollout_s": wait_s, "rollout/groups_kept": float(len({s.group_index for s in batch})),
                        "async/producer_tokens": float(producer.generated_tokens - tokens_before),
                        "async/regenerated": float(producer.regenerated - regenerated_before)}
            if cfg.rollout.dump:
                run.dump(step, every)
            metrics |= evaluated | run.train_on(step, batch)
            metrics |= run.sync_weights()
            if not cfg.runtime.partial_rollouts:
                run.engine.abort_all()  # in-flight groups are regenerated with the new weights
            run._finish_step(step, metrics, batch, t0)
    finally:
        run._snapshot_rollouts = None
        producer.stop_event.set()
        run.engine.abort_all()
        producer.join(timeout=30)
