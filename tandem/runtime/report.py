"""``tandem report RUN_DIR``: PNG plots of a run's metrics and a short text summary.

Plots (each written only when the run logged those metrics): reward, response length, KL, entropy,
phase times per step. The summary compares the first and last steps' reward and lists wall time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tandem.runtime.tracking import read_metrics

__all__ = ["write_report"]

PLOTS: dict[str, tuple[str, list[str]]] = {
    "reward.png": ("Reward", ["reward/mean", "rollout/pass_rate"]),
    "length.png": ("Response length (tokens)", ["rollout/response_len_mean", "rollout/response_len_max"]),
    "kl.png": ("KL", ["kl/k3_mean", "kl/coef", "train_rollout_logprob_abs_diff/mean"]),
    "entropy.png": ("Entropy", ["loss/entropy", "train/entropy"]),
    "phase_times.png": ("Seconds per phase", ["time/rollout_s", "time/reward_s", "time/logprob_s",
                                              "time/train_s", "time/sync_s", "time/step_s"]),
}


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool):
            xs.append(r["step"])
            ys.append(float(v))
    return xs, ys


def write_report(run_dir: str | Path) -> dict[str, Any]:
    """Write the plots and ``summary.txt`` into ``RUN_DIR/report``; return the summary figures."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    skipped: list[int] = []
    rows = read_metrics(run_dir, skipped=skipped)
    if not rows:
        why = f"has no valid line (bad lines: {_lines(skipped)})" if skipped else "is missing or empty"
        raise FileNotFoundError(f"{run_dir}/metrics.jsonl {why}: not a Tandem run directory?")
    out = run_dir / "report"
    out.mkdir(exist_ok=True)
    written = []
    for fname, (title, keys) in PLOTS.items():
        series = {k: _series(rows, k) for k in keys}
        series = {k: v for k, v in series.items() if v[0]}
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        for k, (xs, ys) in series.items():
            ax.plot(xs, ys, marker="o", markersize=3, label=k)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / fname, dpi=100)
        plt.close(fig)
        written.append(fname)
    _, rewards = _series(rows, "reward/mean")
    summary = {
        "steps": len(rows),
        "first_reward": rewards[0] if rewards else None,
        "last_reward": rewards[-1] if rewards else None,
        "wall_s": _wall_s(rows),
        "plots": written,
    }
    if skipped:
        summary["skipped_lines"] = _lines(skipped)
    if len(rewards) >= 4:
        k = max(1, len(rewards) // 4)
        summary["reward_first_quarter"] = sum(rewards[:k]) / k
        summary["reward_last_quarter"] = sum(rewards[-k:]) / k
    lines = [f"{k}: {v}" for k, v in summary.items()]
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    return summary


def _number(row: dict[str, Any], key: str) -> float | None:
    v = row.get(key)
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _wall_s(rows: list[dict[str, Any]]) -> float | None:
    """Seconds from the first step's start to the last step's end (None without timestamps)."""
    first, last = _number(rows[0], "time"), _number(rows[-1], "time")
    if first is None or last is None:
        return None
    return last - first + (_number(rows[0], "time/step_s") or 0.0)


def _lines(numbers: list[int], most: int = 10) -> str:
    shown = ", ".join(map(str, numbers[:most]))
    return shown + (f" and {len(numbers) - most} more" if len(numbers) > most else "")
