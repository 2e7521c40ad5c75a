"""A rich progress bar over steps showing the current phase and the last step's key metrics."""

from __future__ import annotations

import sys

__all__ = ["Progress"]

KEY_METRICS = (("reward/mean", "reward"), ("rollout/response_len_mean", "len"), ("kl/k3_mean", "kl"),
               ("train/grad_norm", "gnorm"), ("time/step_s", "s/step"))


class Progress:
    """``with Progress(...)``: ``phase(step, name)`` while working, ``done(step, metrics)`` per step.

    Disabled (or not a terminal): one plain log line per step instead of a live bar.
    """

    def __init__(self, *, enabled: bool, total: int, start: int = 0) -> None:
        self.total, self.start = total, start
        self.live = enabled and sys.stderr.isatty()
        self._bar = None
        self._task = None
        self._last = ""

    def __enter__(self) -> Progress:
        if self.live:
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(),
                                     TimeElapsedColumn(), TextColumn("{task.description}"), transient=False)
            self._bar.__enter__()
            self._task = self._bar.add_task("", total=self.total, completed=self.start)
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)

    def phase(self, step: int, name: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, description=f"[cyan]{name}[/] {self._last}")

    def done(self, step: int, metrics: dict[str, float]) -> None:
        parts = [f"{label} {metrics[k]:.3g}" for k, label in KEY_METRICS if k in metrics]
        self._last = " | ".join(parts)
        if self._bar is not None:
            self._bar.update(self._task, completed=step + 1, description=self._last)
        else:
            print(f"step {step + 1}/{self.total}: {self._last}", file=sys.stderr, flush=True)
