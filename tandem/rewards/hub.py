"""The reward hub: built-in rewards by name, user rewards by import path, scored concurrently.

A reward is one or more weighted *terms*. A single term gives a float reward; several give a dict
reward ``{"score": weighted sum, "<term>": value, ...}`` whose ``score`` is what advantages use.

A user reward is ``module.path:function``, imported and checked at start-up. It takes one `Sample`
(or, with ``batched: true``, a list of samples) and returns a float or a dict with a ``score`` key (or
a list of them); it may be ``async``. **It runs user code in the Tandem process.**

Failure policy: a term that raises, times out or returns NaN/Inf marks its sample FAILED (the reason
goes to ``sample.metadata["reward_error"]``), is counted in the metrics (the loop logs ``reward/errors``
per step) and in `RewardHub.error_counts` by message, is logged (at WARNING the first time a message
occurs, then at DEBUG), and never stops a step (the loop's ``runtime.max_skipped_steps`` stops a run
whose steps are all skipped). A
timed-out thread cannot be killed: the hub abandons it (it finishes, or hangs, in the background) and
continues on a fresh pool, so one hung reward never starves the later ones.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures as cf
import inspect
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tandem.core.sample import Sample, SampleStatus
from tandem.plugins import PluginError, check_arity, load_callable
from tandem.rewards.builtin import BUILTINS
from tandem.rewards.remote import remote

__all__ = ["RewardConfig", "RewardHub", "RewardTermConfig", "builtin_names"]

log = logging.getLogger(__name__)

_FACTORIES: dict[str, Callable[..., Callable[[Sample], Any]]] = {**BUILTINS, "remote": remote}


def builtin_names() -> list[str]:
    return sorted(_FACTORIES)


@dataclass(kw_only=True, slots=True)
class RewardTermConfig:
    """One reward term: a built-in name (with its options in ``kwargs``) or ``module:function``."""

    name: str
    weight: float = 1.0
    kwargs: dict[str, Any] = field(default_factory=dict)
    batched: bool = False  # import-path rewards only: the function takes a list of samples

    def __post_init__(self) -> None:
        if self.name not in _FACTORIES and ":" not in self.name:
            raise ValueError(
                f"unknown reward {self.name!r} (choose one of: {', '.join(builtin_names())}, "
                "or an import path 'module:function')"
            )


@dataclass(kw_only=True, slots=True)
class RewardConfig:
    """The recipe's ``reward:`` section."""

    terms: list[RewardTermConfig] = field(default_factory=lambda: [RewardTermConfig(name="math")])
    timeout_s: float = 30.0
    num_workers: int = 4

    def __post_init__(self) -> None:
        if not self.terms:
            raise ValueError("terms must hold at least one reward term")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s={self.timeout_s} must be > 0")
        if self.num_workers < 1:
            raise ValueError(f"num_workers={self.num_workers} must be >= 1")
        names = [t.name for t in self.terms]
        if len(set(names)) != len(names):
            raise ValueError(f"reward term names repeat: {names}")


def _term_key(name: str) -> str:
    return name.rsplit(":", 1)[-1]


class _Term:
    def __init__(self, cfg: RewardTermConfig) -> None:
        self.cfg = cfg
        self.key = _term_key(cfg.name)
        if cfg.name in _FACTORIES:
            try:
                self.fn = _FACTORIES[cfg.name](**cfg.kwargs)
            except (TypeError, ValueError) as e:
                raise PluginError(f"reward {cfg.name!r}: bad kwargs {cfg.kwargs}: {e}") from None
            self.batched = False
        else:
            self.fn = load_callable(cfg.name, what="reward")
            check_arity(self.fn, 1, name=f"reward {cfg.name!r}")
            self.batched = cfg.batched
        self.is_async = inspect.iscoroutinefunction(self.fn)


def _as_float(value: Any) -> float:
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"dict reward {value} has no 'score' key")
        value = value["score"]
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"reward is {v}")
    return v


def _call_sync(fn, arg):
    out = fn(arg)
    if inspect.isawaitable(out):

        async def _await():
            return await out

        return asyncio.run(_await())
    return out


class RewardHub:
    """Scores samples with the configured terms, concurrently, in a worker pool."""

    def __init__(self, cfg: RewardConfig) -> None:
        self.cfg = cfg
        self.terms = [_Term(t) for t in cfg.terms]  # imports and checks plugins now, not mid-run
        self._pool = self._new_pool()
        self.error_counts: collections.Counter[str] = collections.Counter()  # message -> failed samples
        self._errors_lock = threading.Lock()

    def _record_errors(self, failed: dict[int, str]) -> None:
        for message, n in collections.Counter(failed.values()).items():
            with self._errors_lock:
                first = message not in self.error_counts
                self.error_counts[message] += n
                total = self.error_counts[message]
            log.log(logging.WARNING if first else logging.DEBUG, "reward error on %d sample(s) (%d so far): %s",
                    n, total, message)

    def _new_pool(self) -> cf.ThreadPoolExecutor:
        return cf.ThreadPoolExecutor(max_workers=self.cfg.num_workers, thread_name_prefix="tandem-reward")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def score(self, samples: Sequence[Sample]) -> dict[str, float]:
        """Set ``reward`` on every sample (FAILED ones get status FAILED); return metrics."""
        t0 = time.perf_counter()
        values: list[dict[str, float]] = [{} for _ in samples]
        failed: dict[int, str] = {}
        n_timeout = 0
        for term in self.terms:
            live = [i for i in range(len(samples)) if i not in failed]
            futures: list[tuple[list[int], cf.Future]] = []
            if term.batched:
                futures.append((live, self._pool.submit(_call_sync, term.fn, [samples[i] for i in live])))
            else:
                futures += [([i], self._pool.submit(_call_sync, term.fn, samples[i])) for i in live]
            for rows, fut in futures:
                try:
                    out = fut.result(timeout=self.cfg.timeout_s)
                    outs = out if term.batched else [out]
                    if len(outs) != len(rows):
                        raise ValueError(
                            f"batched reward returned {len(outs)} values for {len(rows)} samples"
                        )
                    for i, o in zip(rows, outs, strict=True):
                        values[i][term.key] = _as_float(o)
                except cf.TimeoutError:
                    if not fut.cancel():  # running: abandon its thread, keep scoring on a fresh pool
                        self._pool.shutdown(wait=False, cancel_futures=False)
                        self._pool = self._new_pool()
                    n_timeout += len(rows)
                    for i in rows:
                        failed[i] = f"reward {term.cfg.name!r} timed out after {self.cfg.timeout_s}s"
                except Exception as e:  # noqa: BLE001 - a reward bug fails its samples, not the run
                    for i in rows:
                        failed[i] = f"reward {term.cfg.name!r} raised {type(e).__name__}: {e}"
        self._record_errors(failed)
        for i, s in enumerate(samples):
            if i in failed:
                s.status = SampleStatus.FAILED
                s.metadata["reward_error"] = failed[i]
                s.reward = None
                continue
            if len(self.terms) == 1:
                s.reward = values[i][self.terms[0].key]
            else:
                total = sum(t.cfg.weight * values[i][t.key] for t in self.terms)
                s.reward = {"score": total, **values[i]}
        scored = [s.scalar_reward() for i, s in enumerate(samples) if i not in failed]
        metrics = {
            "reward/failed": float(len(failed)),
            "reward/timeout": float(n_timeout),
            "time/reward_s": time.perf_counter() - t0,
        }
        if scored:
            metrics["reward/mean"] = sum(scored) / len(scored)
        for t in self.terms if len(self.terms) > 1 else []:
            vals = [values[i][t.key] for i in range(len(samples)) if i not in failed]
            if vals:
                metrics[f"reward/{t.key}"] = sum(vals) / len(vals)
        return metrics
