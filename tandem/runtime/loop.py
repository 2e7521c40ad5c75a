"""The RL loop: generate -> reward -> filter -> advantages -> ref/old log-probs -> train -> sync.

`Run` owns one run: its components (data, rewards, training engine, inference engine, weight sync),
its position (step, weight version) and its outputs (metrics, checkpoints, rollout dumps). Three modes:

* ``sync``: every step generates with the current weights (on-policy).
* ``one_step_off``: the rollout of step N+1 runs in a worker thread while step N trains; the new
  weights reach the engine between rollouts, so training data is exactly one version old
  (`tandem.runtime.one_step_off`).
* ``fully_async``: see `tandem.runtime.async_loop`.

Placement: ``colocated`` (one process) puts the engine to sleep (KV cache freed) while the trainer
trains and syncs in-process; ``separate`` runs the engine in its own process (`RemoteEngine`) and syncs
by broadcast or disk. Every phase is timed (``time/<phase>_s``) and shown in a progress bar.

Reliability (docs/runtime.md): a watchdog fails a run that completes no step for ``runtime.watchdog_s``
(`tandem.runtime.watchdog`), ``runtime.max_skipped_steps`` consecutive skipped steps fail it, and
SIGINT / SIGTERM stop it at a step boundary with a checkpoint (`tandem.runtime.preemption`).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from tandem.config import save_config, to_dict
from tandem.core.advantages import compute_advantages
from tandem.core.batch import TrainBatch
from tandem.core.contracts import CheckedLoss, ContractCheck
from tandem.core.filters import filter_samples
from tandem.core.sample import Sample, SampleStatus
from tandem.models import load_tokenizer
from tandem.rewards.hub import RewardHub
from tandem.rollout.data import DataSource
from tandem.runtime import builders
from tandem.runtime.allocator import note_allocator
from tandem.runtime.checkpoint import (
    check_resume_target,
    drafter_state,
    load_run_state,
    restore_drafter,
    restore_latest,
    rng_state,
    save_run_checkpoint,
)
from tandem.runtime.config import RunConfig
from tandem.runtime.engine_wire import EngineProcessError
from tandem.runtime.evaluation import Evaluator
from tandem.runtime.metrics import process_metrics, rollout_metrics, speculation_metrics
from tandem.runtime.pending import decode_groups
from tandem.runtime.policy import (
    merge_mini_batch_metrics,
    mini_batch_rows,
    old_log_prob_source,
    run_contract,
    shares_frozen_base,
)
from tandem.runtime.preemption import Preempted, StopSignals, StuckInterrupt
from tandem.runtime.progress import Progress
from tandem.runtime.rollouts import Rollouts
from tandem.runtime.tracking import Tracker
from tandem.runtime.watchdog import SkipCounter, Stalled, Watchdog
from tandem.sync import build_sender
from tandem.sync.inprocess import share_frozen_base

__all__ = ["Run"]

log = logging.getLogger(__name__)


class Run:
    """One training run. ``Run(cfg, run_dir).train()`` runs it to ``cfg.run.steps``."""

    def __init__(self, cfg: RunConfig, run_dir: str | Path, *, resume: bool = False, overwrite: bool = False,
                 resume_from: str | Path | None = None) -> None:
        """``resume``: continue from the run's newest good checkpoint, or from ``resume_from`` (one of its
        ``checkpoints/step_K`` folders) when given."""
        run_dir = Path(run_dir)
        self._resume_from = Path(resume_from) if resume_from is not None else None
        resume = resume or self._resume_from is not None
        previous = (run_dir / "metrics.jsonl").exists() or (run_dir / "checkpoints").exists()
        if previous and not resume and not overwrite:
            raise FileExistsError(
                f"{run_dir} already holds a run: continue it with --resume {run_dir}, pick another --run-dir, "
                "or pass --overwrite to replace it"
            )
        builders.check_placement(cfg)
        builders.check_load_dump(cfg)
        note_allocator(cfg.runtime.allocator, cfg.runtime.malloc_mmap_threshold)  # before anything large
        if resume:  # nothing left to do is said now, before anything is built
            check_resume_target(run_dir, cfg.run.steps)
        # every engine setting the run asks for is checked now, before anything is built
        self.plan = builders.plan_engines(cfg)
        self.generate_fn = builders.check_rollout(cfg)
        self.cfg = cfg
        self.run_dir = run_dir
        if overwrite and not resume:
            shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(cfg.run.seed)
        self.tokenizer = load_tokenizer(cfg.model.name)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.data = DataSource(cfg.data, self.tokenizer)
        self.rewards = RewardHub(cfg.reward)
        self.engine: Any = None
        self.sync: Any = None
        self.trainer: Any = None
        self.evaluator: Evaluator | None = None
        self.separate = cfg.runtime.placement == "separate"
        self.cluster: Any = None  # runtime.placement: ray (tandem.runtime.ray.placement.RayPlacement)
        if cfg.runtime.placement == "ray":
            from tandem.runtime.ray.placement import RayPlacement

            self.cluster = RayPlacement(cfg, **builders.ray_gpus(cfg, self.plan))
        # the engine shares the trainer's memory: it sleeps while the trainer trains
        self.shares_memory = cfg.runtime.placement == "colocated" or (
            self.cluster is not None and cfg.ray.layout == "colocated")
        if self.separate:  # the engine process starts while this one builds the trainer
            self.engine, self.sync = builders.build_separate(cfg, self.plan)
        try:
            self._init_components(resume)
        except BaseException:
            self._release_partial()
            raise

    def _init_components(self, resume: bool) -> None:
        cfg = self.cfg
        if self.cluster is not None:
            self.cluster.start(trainer_spec=builders.training_engine_spec(cfg, self.plan),
                               engine_spec=builders.inference_engine_spec(cfg, self.plan))
            self.trainer, self.engine, self.sync = self.cluster.trainer, self.cluster.router, self.cluster
        else:
            self.trainer = builders.build_training_engine(cfg, self.plan)
        if self.separate:
            self.engine.wait_ready()
        elif self.cluster is None:  # a LoRA engine is built on the trainer's frozen base: no copy of its own
            self.engine = builders.build_inference_engine(cfg, self.plan, trainer=self.trainer)
            self.sync = build_sender(cfg.sync, engine=self.engine)
        # under ray the weight sync reaches the replicas' engines directly: check their own info
        engine_info = self.cluster.replica_info if self.cluster is not None else self.engine.info
        builders.check_built(self.plan, self.trainer.info, engine_info)
        self.rollouts = Rollouts(cfg, generate=self.generate_fn, engine=self.engine, tokenizer=self.tokenizer,
                                 rewards=self.rewards, data=self.data, routed_experts=self.trainer.info.routed_experts)
        self.evaluator = Evaluator(cfg.eval, engine=self.engine, tokenizer=self.tokenizer, generate=self.generate_fn,
                                   run_reward=cfg.reward, rollout_config=cfg.rollout,
                                   routed_experts=self.trainer.info.routed_experts) if cfg.eval.sets else None
        self.kl_ctl = cfg.algorithm.kl_controller()
        self.contract = run_contract(cfg, self.trainer.info, self.engine.info,
                                     hints={**self.plan.trainer.hints, **self.plan.engine.hints})
        self.contract_check = ContractCheck(contract=self.contract, on_violation=cfg.algorithm.contract.on_violation)
        self.old_source = old_log_prob_source(cfg, self.contract)
        log.info("log-prob contract: %s (%s); old log-probs: %s", self.contract.relation, self.contract.note,
                 self.old_source)
        self.step, self.version = 0, 0
        self._resumed_rollouts: dict[str, Any] | None = None  # rollouts in flight in the checkpoint
        self._snapshot_rollouts: Any = None  # fully async: the producer's (data state, rollouts) for a checkpoint
        self._save_due = False  # one-step-off: a checkpoint waits for the rollout in flight
        resume_step = None
        if resume:
            found = (restore_latest(self.run_dir, self.trainer, bucket_bytes=cfg.sync.bucket_bytes)
                     if self._resume_from is None else
                     (self._resume_from, load_run_state(self._resume_from, self.trainer,
                                                        bucket_bytes=cfg.sync.bucket_bytes)))
            if found is None:
                raise FileNotFoundError(f"--resume: no complete, intact checkpoint under {self.run_dir}/checkpoints")
            ckpt, state = found
            check_resume_target(self.run_dir, cfg.run.steps, step=state["step"], ckpt=ckpt)
            self.step, self.version = state["step"], state["version"]
            self.data.load_state_dict(state["data"])
            self.kl_ctl.load_state_dict(state["kl"])
            self._resumed_rollouts = state.get("rollouts")
            resume_step = self.step - 1
            # The engine starts from the model files; bring it to the checkpoint's weights (one-step-off
            # with the batch in flight saved: its first step sends them before the engine is used)
            if not self._continues_pending():
                if state.get("trainer_ahead"):  # one-step-off: these weights were never sent; a new version
                    self.version += 1
                self._push_weights(self.version)
            restore_drafter(ckpt, self.engine)
            log.info("resumed %s at step %d (weight version %d)", ckpt, self.step, self.version)
        if shares_frozen_base(cfg):
            share_frozen_base(self.trainer, self.engine)  # one copy of a LoRA base in the process, not two
        save_config(cfg, self.run_dir / "config.yaml")
        self.tracker = Tracker(cfg.tracking, self.run_dir, run_name=cfg.run.name, resume_step=resume_step,
                               config=to_dict(cfg))
        self.progress = Progress(enabled=cfg.tracking.progress, total=cfg.run.steps, start=self.step)
        self.watchdog = Watchdog(cfg.runtime.watchdog_s)
        self.signals = StopSignals(phase=self.watchdog.current_phase)
        self.watchdog.on_expire = self.signals.interrupt
        self.skips = SkipCounter(cfg.runtime.max_skipped_steps)
        self._asleep = False
        self._initial_state = {"data": self.data.state_dict(), "kl": self.kl_ctl.state_dict()}
        self._completed = self._state()  # what a checkpoint of the last completed step holds
        self._saved_step: int | None = self.step if resume else None

    # -- phases ---------------------------------------------------------------------------------------

    def rollout(self, step: int) -> tuple[list[Sample], dict[str, float]]:
        """Generate, score and filter until ``prompts_per_step`` groups survive (or ``max_rounds``)."""
        if self.cfg.rollout.load_dump:
            return self._load_dump(step)
        kept, everything, metrics = self.rollouts.step(step, phase=lambda name: self.phase(step, name))
        metrics |= self.skips.note_samples(step, everything)
        if self.cfg.rollout.dump:
            self.dump(step, everything)
        return kept, metrics

    def phase(self, step: int, name: str) -> None:
        """The loop enters phase ``name`` of ``step``: shown in the progress bar, watched by the watchdog."""
        self.progress.phase(step, name)
        self.watchdog.phase(step, name)

    def train_on(self, step: int, samples: Sequence[Sample]) -> dict[str, float]:
        """Advantages, reference log-probs / values, one optimizer step."""
        if not samples:
            log.warning("step %d: no sample survived the filters, so the update is skipped (filter/dropped_* in "
                        "metrics.jsonl say why; drop_zero_std_groups drops groups whose samples all scored the "
                        "same, as every group of a solved task does)", step)
            return {"train/skipped_step": 1.0, "train/no_samples": 1.0}
        alg = self.cfg.algorithm
        batch = TrainBatch.from_samples(samples, pad_token_id=self.pad_id)
        self.phase(step, "logprobs")
        t0 = time.perf_counter()
        if alg.needs_ref:
            batch = batch.replace(ref_log_probs=self.trainer.forward_logprobs(batch, model="ref").log_probs)
        if alg.needs_critic:
            batch = batch.replace(values=self.trainer.forward_logprobs(batch, model="critic").values)
        logprob_s = time.perf_counter() - t0
        metrics: dict[str, float] = {}
        if self.old_source == "rollout":  # exact contract: the rollout log-probs are the trainer's
            batch = batch.replace(old_log_probs=batch.rollout_log_probs)
        elif self.old_source == "recompute":
            t1 = time.perf_counter()
            old = self.trainer.forward_logprobs(batch).log_probs
            metrics["time/old_logprob_s"] = time.perf_counter() - t1
            if self.cfg.runtime.mode == "sync":  # same weights on both sides: the contract applies
                metrics |= self.contract_check.check(old, batch)
            batch = batch.replace(old_log_probs=old)
        kl_coef = self.kl_ctl.coef_at(step)
        batch, adv_metrics = compute_advantages(batch, alg.advantage, kl=alg.kl, kl_coef=kl_coef)
        metrics |= adv_metrics
        self.phase(step, "train")
        t0 = time.perf_counter()
        loss_fn = alg.build_loss_fn(kl_coef=kl_coef)
        parts = []
        for i, rows in enumerate(mini_batch_rows(batch, alg.mini_batches)):
            mb = batch if alg.mini_batches == 1 else batch.select(rows)
            # the first update sees pre-update log-probs: that is where the contract is checked
            check = i == 0 and self.old_source != "recompute" and self.cfg.runtime.mode == "sync"
            fn = CheckedLoss(loss_fn, self.contract_check) if check else loss_fn
            parts.append(self.trainer.train_step(mb, fn))
        metrics |= merge_mini_batch_metrics(parts)
        if alg.needs_critic:
            critic = self.trainer.train_step(batch, alg.build_value_loss_fn(), model="critic")
            metrics |= {f"critic/{k.split('/', 1)[-1]}": v for k, v in critic.items()}
        kl_now = metrics.get("kl/k3_mean", metrics.get("kl/mean"))
        self.kl_ctl.update(current_kl=kl_now)
        metrics |= {"time/logprob_s": logprob_s, "time/train_s": time.perf_counter() - t0, "kl/coef": kl_coef,
                    "train/tokens": float(batch.num_loss_tokens)}
        return metrics

    def sync_weights(self) -> dict[str, float]:
        """Send the trainer's weights as the next version; the version moves only once the engine has it."""
        self.phase(self.step, "sync")
        t0 = time.perf_counter()
        version = self.version + 1
        metrics = self._push_weights(version)
        self.version = version
        return metrics | {"time/sync_s": time.perf_counter() - t0, "sync/version": float(self.version)}

    def _push_weights(self, version: int) -> dict[str, float]:
        if self.cluster is not None:  # trainer rank 0 -> object store -> every replica
            return self.cluster.push_weights(version)
        buckets = self.trainer.named_parameters_for_sync(self.cfg.sync.bucket_bytes)
        if not self.separate:
            return self.sync.send(buckets, version)

        def send() -> dict[str, float]:
            metrics = self.sync.send(buckets, version)
            # disk applies in the engine's own time; broadcast has applied when send returns
            self.engine.wait_for_version(version, timeout_s=self.cfg.sync.timeout_s)
            return metrics

        # a collective with a dead engine process would wait sync.timeout_s: fail as soon as it dies
        try:
            return self.engine.run_while_alive(send, what="weight sync")
        except EngineProcessError:
            # release the abandoned send's wait for the dead receiver: a thread left inside a C++
            # rendezvous would also abort the interpreter at exit
            sender = getattr(self.sync, "sender", self.sync)  # under a quantize-on-send wrapper
            getattr(sender, "cancel", lambda: None)()
            raise

    # -- modes ----------------------------------------------------------------------------------------

    def train(self, *, close: bool = True) -> dict[str, Any]:
        """Run to ``cfg.run.steps``; returns a summary (steps, wall time, run dir).

        The run is closed afterwards (engines, trainer, trackers released), also on an error. With
        ``close=False`` a finished run stays open, its trainer and engine usable (to inspect or evaluate
        the trained policy); close it then with `close` or a ``with`` block. An error still closes it.
        """
        t0 = time.perf_counter()
        failed = True
        try:
            with self.progress, self.signals, self.watchdog:
                self._train_guarded()
            failed = False
        finally:
            if close or failed:
                self.close()
        return {"steps": self.step, "wall_s": time.perf_counter() - t0, "run_dir": str(self.run_dir)}

    def _train_guarded(self) -> None:
        """`_train_mode`, with trainer restarts (Ray), the watchdog's error and a checkpoint on a stop signal."""
        try:
            while True:
                try:
                    self._train_mode()
                    return
                except Exception as e:
                    if not self._restart_trainer(e):
                        raise
        except StuckInterrupt:
            raise Stalled(self.watchdog.expired) from None
        except Preempted as stop:
            self.watchdog.stop()
            stop.step = self.step
            stop.checkpoint = self._save_completed()
            log.warning("%s; continue with --resume %s", stop, self.run_dir)
            raise

    def poll_stop(self) -> None:
        """For the loop's waits: raise if the watchdog expired or a stop signal may abandon the step."""
        self.signals.check()

    def _train_mode(self) -> None:
        mode = self.cfg.runtime.mode
        if mode == "sync":
            self._train_sync()
        elif mode == "one_step_off":
            from tandem.runtime.one_step_off import train_one_step_off

            train_one_step_off(self)
        else:
            from tandem.runtime.async_loop import train_fully_async

            train_fully_async(self)
        self._final_eval()

    def _restart_trainer(self, error: Exception) -> bool:
        """Ray placement: a trainer rank died. Rebuild the group and continue from the last checkpoint (or
        from the start), with a new weight version; False if this is not such a failure or no restart is
        left (``runtime.max_trainer_restarts``)."""
        from tandem.runtime.ray.trainer import TrainerGroupError

        if self.cluster is None or not isinstance(error, TrainerGroupError):
            return False
        if self.cluster.trainer_restarts >= self.cfg.runtime.max_trainer_restarts:
            log.error("the trainer group failed and runtime.max_trainer_restarts=%d restarts are used up",
                      self.cfg.runtime.max_trainer_restarts)
            return False
        lost_at = self.step
        self.trainer = self.cluster.rebuild_trainer()
        found = restore_latest(self.run_dir, self.trainer, bucket_bytes=self.cfg.sync.bucket_bytes)
        ckpt = found[0] if found else None
        if found is not None:
            state = found[1]
            self.step = state["step"]
            self.data.load_state_dict(state["data"])
            self.kl_ctl.load_state_dict(state["kl"])
            self._resumed_rollouts = state.get("rollouts")
        else:  # nothing saved yet: the fresh group holds the initial weights
            self.step = 0
            self.data.load_state_dict(self._initial_state["data"])
            self.kl_ctl.load_state_dict(self._initial_state["kl"])
        self.tracker.rewind(self.step - 1)
        self._save_due = False
        self._completed = self._state()
        # versions never go backwards: the restored weights reach the replicas as a new version
        self.version += 1
        self._push_weights(self.version)
        log.warning("trainer group restarted (%d of %d) after: %s; resumed at step %d from %s (the step in flight, "
                    "%d, and the ones after the checkpoint are done again)", self.cluster.trainer_restarts,
                    self.cfg.runtime.max_trainer_restarts, error, self.step, ckpt or "the initial weights", lost_at)
        return True

    def close(self) -> None:
        """Release the trackers, reward workers, engine and trainer; `train` ends with it. Idempotent:
        a caller that builds a `Run` and stops before `train` (a failed check) closes it too."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        self.tracker.close()
        self.rewards.close()
        if self.evaluator is not None:
            self.evaluator.close()
        self._close_engine()
        self.trainer.close()  # e.g. Megatron's process-wide state

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _release_partial(self) -> None:
        """A failed start-up (a refused capability, a trainer that failed to build): release what exists."""
        self.rewards.close()
        if self.cluster is not None:
            self.cluster.close()
            return
        if self.engine is not None:
            if self.sync is not None:
                self._close_engine()
            else:
                self.engine.close()
        if self.trainer is not None:
            self.trainer.close()

    def _close_engine(self) -> None:
        if self.cluster is not None:
            self.cluster.close()
            return
        if not self.separate or self.engine.alive:
            self.sync.close()  # a receiver in the engine process stops waiting for updates
        self.engine.close()

    def _wake(self) -> None:
        if self._asleep:
            self.engine.wake_up()
            self._asleep = False

    def _sleep(self) -> None:
        # a separate engine keeps its memory; so does one without a sleep mode (vLLM on CPU)
        if not self._asleep and self.shares_memory and self.engine.info.can_sleep:
            self.engine.sleep()
            self._asleep = True

    def eval_at(self, step: int) -> dict[str, float]:
        """``eval/*`` metrics when an evaluation is due at the start of ``step`` (before the first step,
        every ``eval.every`` steps), at the engine's current weights; {} otherwise."""
        if self.evaluator is None or not self.evaluator.due(step, first=step, last=self.cfg.run.steps):
            return {}
        self.phase(step, "eval")
        self._wake()
        return self.evaluator.run()

    def _final_eval(self) -> None:
        """After the last step: a row of its own, ``step = run.steps`` (the weights that step produced)."""
        steps = self.cfg.run.steps
        if self.evaluator is not None and self.step == steps and self.evaluator.due(steps, first=0, last=steps):
            metrics = self.eval_at(steps)
            self.tracker.log(steps, metrics)
            log.info("eval after step %d: %s", steps - 1,
                     {k: round(v, 4) for k, v in metrics.items() if k.endswith(("pass@1", "reward_mean"))})

    def _continues_pending(self) -> bool:
        saved = self._resumed_rollouts
        return self.cfg.runtime.mode == "one_step_off" and saved is not None and saved["mode"] == "one_step_off"

    def take_resumed_rollouts(self, mode: str) -> dict[str, Any] | None:
        """The rollouts in flight that the checkpoint resumed from holds, if they were saved in ``mode``;
        saved in another mode, their prompts are requeued (generated again) and None is returned."""
        saved, self._resumed_rollouts = self._resumed_rollouts, None
        if saved is None or saved["mode"] == mode:
            return saved
        if saved["mode"] == "one_step_off":
            self.data.load_state_dict(saved["data_before"])
        else:
            self.data.requeue(self.data.records[place] for place, _, _ in decode_groups(saved["queued"]))
        log.info("the checkpoint's rollouts in flight were made in %s mode; their prompts are generated again",
                 saved["mode"])
        return None

    def _train_sync(self) -> None:
        self.take_resumed_rollouts("sync")
        for step in range(self.step, self.cfg.run.steps):
            t0 = time.perf_counter()
            evaluated = self.eval_at(step)
            self.phase(step, "rollout")
            self._wake()
            samples, metrics = self.rollout(step)
            metrics |= evaluated
            self._sleep()  # colocated: free the KV cache while the trainer works
            metrics |= self.train_on(step, samples)
            metrics |= self.sync_weights()
            self._finish_step(step, metrics, samples, t0)

    # -- bookkeeping ----------------------------------------------------------------------------------

    def _speculation_metrics(self) -> dict[str, float]:
        """With ``rollout.speculative``: this step's speculation figures (`speculation_metrics`)."""
        if self.cfg.rollout.speculative is None:
            return {}
        out, self._spec_counts = speculation_metrics(self.engine.health(), getattr(self, "_spec_counts", None))
        return out

    def _finish_step(self, step: int, metrics: dict[str, float], samples: Sequence[Sample], t0: float, *,
                     defer_save: bool = False, data: dict[str, Any] | None = None) -> None:
        """Log, count, checkpoint when due (``defer_save``: one-step-off saves once the rollout in flight is
        complete; ``data``: the data position before it took its prompts)."""
        self.phase(step, "finish")
        self.step = step + 1
        self._completed = self._state(data=data)
        if self.cluster is not None:
            metrics |= self.cluster.metrics()
        metrics |= self._speculation_metrics()
        metrics["time/step_s"] = time.perf_counter() - t0
        metrics |= process_metrics()
        self.tracker.log(step, metrics)
        self.progress.done(step, metrics)
        self.watchdog.step_done()
        self.skips.update(step, metrics)  # raises after runtime.max_skipped_steps skipped steps in a row
        every = self.cfg.run.save_every
        due = bool(every and self.step % every == 0) or self.step == self.cfg.run.steps
        self._save_due = due and defer_save
        if due and not defer_save:
            self.save()
        self.phase(self.step, "next step")
        self.signals.check_after_step()  # a stop signal during the step: stop here

    def _state(self, *, data: dict[str, Any] | None = None, rollouts: dict[str, Any] | None = None
               ) -> dict[str, Any]:
        """What a checkpoint of the current step holds besides the trainer: ``data`` (default: the source's
        position now) and ``rollouts`` in flight (fully async: the producer's snapshot)."""
        if rollouts is None and self._snapshot_rollouts is not None:
            data, rollouts = self._snapshot_rollouts()
        state = {"version": self.version, "data": data if data is not None else self.data.state_dict(),
                 "kl": self.kl_ctl.state_dict(), "rng": rng_state()}
        if rollouts is not None:
            state["rollouts"] = rollouts
        if self.cfg.runtime.mode == "one_step_off" and self.step > 0:
            state["trainer_ahead"] = True  # the trainer's last update reaches the engine with the next step
        return state

    def save(self, state: dict[str, Any] | None = None) -> Path:
        """Checkpoint the run at its current step (the end of the last completed one)."""
        path = save_run_checkpoint(self.run_dir, self.step, self.trainer, state or self._state(), self.cfg,
                                   keep=self.cfg.run.keep_checkpoints, bucket_bytes=self.cfg.sync.bucket_bytes,
                                   drafter_state=drafter_state(self.engine))
        self._saved_step = self.step
        self._save_due = False
        return path

    def _save_completed(self) -> Path | None:
        """A stop signal: checkpoint the last completed step (as it stood when that step ended)."""
        if self._saved_step == self.step:
            return self.run_dir / "checkpoints" / f"step_{self.step}"
        if self.step == 0:
            log.warning("stopped before the first step completed: nothing to save")
            return None
        path = save_run_checkpoint(self.run_dir, self.step, self.trainer, self._completed, self.cfg,
                                   keep=self.cfg.run.keep_checkpoints, bucket_bytes=self.cfg.sync.bucket_bytes,
                                   drafter_state=drafter_state(self.engine))
        self._saved_step = self.step
        return path

    def _load_dump(self, step: int) -> tuple[list[Sample], dict[str, float]]:
        """``--debug-train-only``: the samples a previous run dumped for this step, filtered as usual."""
        path = Path(self.cfg.rollout.load_dump) / f"step_{step}.jsonl"
        if not path.is_file():
            raise FileNotFoundError(f"--debug-train-only: no dump for step {step} ({path})")
        samples = []
        for line in path.read_text().splitlines():
            row = json.loads(line)
            row["status"] = SampleStatus(row["status"])
            samples.append(Sample(**row))
        kept, _dropped, metrics = filter_samples(samples, self.cfg.algorithm.filters)
        return kept, rollout_metrics(samples, seconds=0.0) | metrics

    def dump(self, step: int, samples: Sequence[Sample]) -> None:
        """``rollout.dump``: every sample generated for ``step`` (filtered ones too) as JSON lines."""
        out = self.run_dir / "rollouts"
        out.mkdir(exist_ok=True)
        with (out / f"step_{step}.jsonl").open("w") as f:
            for s in samples:
                row = {k: getattr(s, k) for k in ("prompt", "response", "tokens", "response_length", "loss_mask",
                                                  "rollout_log_probs", "reward", "label", "weight_versions",
                                                  "group_index", "index", "metadata")}
                row["status"] = s.status.value
                f.write(json.dumps(row, default=str) + "\n")

