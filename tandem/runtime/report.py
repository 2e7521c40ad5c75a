"""``tandem report RUN_DIR``: PNG plots of a run's metrics, a short text summary and one HTML page.

Plots (each written only when the run logged those metrics): reward, response length, KL, entropy,
phase times per step, and the eval sets' pass@1 (``eval/<set>/*``). The summary compares the first
and last steps' reward, lists wall time and each eval set's first and last figures. ``report.html``
holds it all in one file (plots inline, the resolved config, the summary, the eval table).
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
    "phase_times.png": ("Seconds per phase", ["time/generate_s", "time/reward_s", "time/logprob_s",
                                              "time/train_s", "time/sync_s", "time/step_s"]),
}
EVAL_METRICS = ("pass@1", "reward_mean", "maj@1", "length_mean")  # the eval table's columns, when logged


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
    eval_sets = sorted({k.split("/")[1] for r in rows for k in r if k.startswith("eval/") and k.count("/") == 2})
    plots = dict(PLOTS)
    if eval_sets:
        plots["eval.png"] = ("Eval sets: pass@1", [f"eval/{s}/pass@1" for s in eval_sets])
    for fname, (title, keys) in plots.items():
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
        "steps": sum(1 for r in rows if not _eval_only(r)),  # the evaluation after the last step is no step
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
    table = eval_table(rows)
    if table:
        summary["eval"] = {name: {f"{m} ({when})": v for when, figures in row.items() for m, v in figures.items()}
                           for name, row in table.items()}
    lines = [f"{k}: {v}" for k, v in summary.items()]
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    _write_html(run_dir, out, summary, table, written)
    return summary


def eval_table(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """Per eval set: ``{"first": {metric: value}, "last": {...}}`` (its first and last evaluation)."""
    table: dict[str, dict[str, dict[str, float]]] = {}
    for r in rows:
        for key, value in r.items():
            parts = key.split("/")
            if len(parts) != 3 or parts[0] != "eval" or parts[2] not in EVAL_METRICS:
                continue
            entry = table.setdefault(parts[1], {"first": {}, "last": {}})
            entry["first"].setdefault(parts[2], value)
            entry["last"][parts[2]] = value
    return table


def _write_html(run_dir: Path, out: Path, summary: dict[str, Any], table: dict, plots: list[str]) -> None:
    """``report.html``: one file with the plots inline (base64), the summary, the eval table, the config."""
    import base64
    import html

    config = (run_dir / "config.yaml").read_text() if (run_dir / "config.yaml").is_file() else "(no config.yaml)"
    parts = [f"<h1>{html.escape(run_dir.name)}</h1>", "<h2>Summary</h2><table>"]
    parts += [f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>"
              for k, v in summary.items() if k not in ("eval", "plots")]
    parts.append("</table>")
    if table:
        metrics = [m for m in EVAL_METRICS if any(m in row["first"] for row in table.values())]
        head = "".join(f"<th>{m} first</th><th>{m} last</th>" for m in metrics)
        parts.append(f"<h2>Eval sets</h2><table><tr><th>set</th>{head}</tr>")
        for name, row in table.items():
            cells = "".join(f"<td>{row['first'].get(m, float('nan')):.3f}</td><td>{row['last'].get(m, float('nan')):.3f}</td>"
                            for m in metrics)
            parts.append(f"<tr><th>{html.escape(name)}</th>{cells}</tr>")
        parts.append("</table>")
    parts.append("<h2>Plots</h2>")
    for name in plots:
        data = base64.b64encode((out / name).read_bytes()).decode()
        parts.append(f'<p><img alt="{html.escape(name)}" src="data:image/png;base64,{data}"></p>')
    parts.append(f"<h2>Config</h2><pre>{html.escape(config)}</pre>")
    style = "body{font-family:sans-serif;max-width:60em}table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 6px}"
    (out / "report.html").write_text(f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(run_dir.name)}"
                                     f"</title><style>{style}</style></head><body>{''.join(parts)}</body></html>\n")


def _eval_only(row: dict[str, Any]) -> bool:
    keys = [k for k in row if k not in ("step", "time")]
    return bool(keys) and all(k.startswith(("eval/", "time/eval")) for k in keys)


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
