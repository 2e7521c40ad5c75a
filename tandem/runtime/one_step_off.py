"""``one_step_off`` mode: the rollout of step N+1 runs in a worker thread while step N trains.

The new weights reach the engine between rollouts (after rollout N+1 is complete, before rollout N+2
starts), so training data is exactly one version old. A checkpoint of step N is written once rollout N+1
is complete and holds it (`tandem.runtime.pending`): a resumed run trains on the same batch and repeats
the uninterrupted run bit for bit. A stop before that saves the data position from before the rollout took
its prompts (they are generated again after a resume).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from tandem.runtime.metrics import staleness_metrics
from tandem.runtime.pending import decode_samples, encode_samples
from tandem.runtime.watchdog import Background

if TYPE_CHECKING:
    from tandem.runtime.loop import Run

__all__ = ["train_one_step_off"]


def train_one_step_off(run: Run) -> None:
    """Rollout N+1 runs while step N trains. The checkpoint of step N is written once rollout N+1 is
    complete and holds it (`tandem.runtime.pending`), so a resumed run trains on the same batch."""
    start = run.step
    saved = run.take_resumed_rollouts("one_step_off")
    data_before = run.data.state_dict()  # the prompts of the rollout in flight are not taken yet
    if saved is None:
        # a daemon thread, not a pool: a rollout that hangs must not keep the process from exiting
        pending = Background(run.rollout, start, name="tandem-rollout")
    else:
        pending = Background(lambda: (decode_samples(saved["samples"]), dict(saved["metrics"])),
                             name="tandem-rollout")
    try:
        for step in range(start, run.cfg.run.steps):
            t0 = time.perf_counter()
            run.phase(step, "wait for rollouts")
            try:
                samples, metrics = pending.result(poll=run.poll_stop)
            except Exception:
                if run._save_due:  # the rollout failed, the trainer's step did not: keep it
                    run.save(run._completed)
                raise
            if step > start:  # the end of step - 1 as a checkpoint holds it: this rollout included
                run._completed = run._state(rollouts={
                    "mode": "one_step_off", "data_before": data_before, "samples": encode_samples(samples),
                    "metrics": metrics})
                if run._save_due:
                    run.save(run._completed)
            if step > start or saved is not None:
                metrics |= run.sync_weights()  # the weights trained last step reach the idle engine
            metrics |= run.eval_at(step)  # the engine now holds the weights of step - 1
            metrics |= staleness_metrics(samples, run.version)
            last = step + 1 == run.cfg.run.steps
            if not last:
                data_before = run.data.state_dict()
                pending = Background(run.rollout, step + 1, name="tandem-rollout")
            metrics |= run.train_on(step, samples)
            # a stop before rollout step + 1 completes saves without it (it is generated again)
            run._finish_step(step, metrics, samples, t0, defer_save=not last, data=data_before)
        if run.step > start:
            run.sync_weights()  # the last update reaches the engine too
    finally:
        if not pending.done():  # the run stopped early: end the rollout in flight (a hung one stays behind)
            run.engine.abort_all()
            pending.join(timeout_s=5)
