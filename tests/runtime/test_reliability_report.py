"""Issue 23: a bad line in metrics.jsonl (a run killed mid-write, a hand edit) never stops a report or a resume."""

from __future__ import annotations

import json

from tandem.cli import main
from tandem.runtime.report import write_report
from tandem.runtime.tracking import Tracker, TrackingConfig, read_metrics

LINES = [
    json.dumps({"step": 0, "time": 100.0, "reward/mean": 0.1, "time/step_s": 2.0}),
    "this is not json",
    json.dumps([1, 2, 3]),
    json.dumps({"no_step": 1}),
    json.dumps({"step": 1, "time": 103.0, "reward/mean": 0.3}),
    '{"step": 2, "time": 10',  # the half-written line of a killed run
]


def _run_dir(tmp_path, lines=LINES):
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return tmp_path


def test_read_metrics_skips_bad_lines_and_names_them(tmp_path, caplog):
    skipped: list[int] = []
    rows = read_metrics(_run_dir(tmp_path), skipped=skipped)
    assert [r["step"] for r in rows] == [0, 1] and skipped == [2, 3, 4, 6]
    assert "metrics.jsonl:6: skipping a bad metrics line" in caplog.text


def test_report_of_a_run_with_bad_lines(tmp_path, capsys):
    summary = write_report(_run_dir(tmp_path))
    assert summary["steps"] == 2 and summary["last_reward"] == 0.3 and summary["wall_s"] == 5.0
    assert summary["skipped_lines"] == "2, 3, 4, 6" and (tmp_path / "report" / "reward.png").is_file()
    assert main(["report", str(tmp_path)]) == 0
    assert "skipped_lines: 2, 3, 4, 6" in capsys.readouterr().out


def test_report_without_a_valid_line_is_one_line(tmp_path, capsys):
    _run_dir(tmp_path, ["garbage", '{"step": "x"}'])
    assert main(["report", str(tmp_path)]) == 2
    out = capsys.readouterr()
    text = (out.out + out.err).strip()
    assert "\n" not in text and "has no valid line (bad lines: 1, 2)" in text and "Traceback" not in text


def test_resume_drops_a_half_written_last_line(tmp_path):
    _run_dir(tmp_path)
    tracker = Tracker(TrackingConfig(progress=False), tmp_path, run_name="r", resume_step=1)
    tracker.log(2, {"reward/mean": 0.5})
    tracker.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2]
    assert all(json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines())
