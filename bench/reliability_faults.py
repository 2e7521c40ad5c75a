"""`bench/reliability.py`, group 3: injected faults."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.reliability_cli import _progress, _quote, _user_folder, classify_cli
from bench.reliability_common import (
    EVEN,
    MARKER_ENV,
    OFF_POLICY,
    RECIPE,
    SEPARATE,
    SLOW_EVEN,
    Context,
    Outcome,
    Proc,
    _env,
    _kill_group,
    launch,
    metrics_rows,
    metrics_steps,
    tail,
    tandem,
    traceback_summary,
)

# -- group 3: faults ----------------------------------------------------------------------------------------------


@dataclass
class FaultCase:
    name: str
    survived_means: str
    run: Callable[[Context, Path], tuple[str, str, str, int]]  # -> (outcome, command, detail, data_lost)
    quick: bool = False


def _train(ctx: Context, work: Path, overrides: list[str], run_dir: Path, *, recipe: Path = RECIPE,
           timeout: float = 180, extra: list[str] = (), env: dict | None = None) -> tuple[Proc, str]:
    args = ["train", str(recipe), *overrides, "--run-dir", str(run_dir), "--quiet", *extra]
    p = tandem(args, work, timeout, env=env)
    _save_log(work, args, p.rc, p.err)
    return p, ctx.display("tandem " + " ".join(_quote(a) for a in args))


def _save_log(work: Path, args: list[str], rc: int | None, err: str) -> None:
    """The full stderr of a fault's process, beside its run (kept with --keep)."""
    n = len(list(work.glob("log-*.txt")))
    (work / f"log-{n}.txt").write_text(f"$ tandem {' '.join(args)}\nexit {rc}\n{err}")


def _failed_with(p: Proc, codes: tuple[int, ...], *names: str) -> tuple[str, str]:
    """A run that had to stop: the given exit code, one error line naming ``names``, no traceback."""
    outcome, why = classify_cli(p, codes, list(names))
    return ("survived" if outcome == "clear" else outcome), why


def fault_reward_always_raises(ctx: Context, work: Path):
    run_dir = work / "run"
    p, cmd = _train(ctx, work, ["reward.terms=[{name: 'bench.reliability:always_fails'}]", "run.steps=10",
                                "runtime.max_skipped_steps=3"], run_dir)
    outcome, why = _failed_with(p, (1,), "3 consecutive steps were skipped", "the judge is unreachable")
    steps = metrics_steps(run_dir)
    if outcome == "survived" and steps != [0, 1, 2]:
        outcome, why = "failed", f"metrics steps {steps}, expected [0, 1, 2]; {why}"
    return outcome, cmd, why, 0


def fault_reward_always_raises_async(ctx: Context, work: Path):
    run_dir = work / "run"
    p, cmd = _train(ctx, work, ["reward.terms=[{name: 'bench.reliability:always_fails'}]", "run.steps=10",
                                "runtime.max_skipped_steps=3", "runtime.mode=fully_async", *OFF_POLICY], run_dir)
    outcome, why = _failed_with(p, (1,), "consecutive steps were skipped", "the judge is unreachable")
    return outcome, cmd, why, 0


def _hang_or_exit_once(reward: str, isolation: str):
    def run(ctx: Context, work: Path):
        run_dir = work / "run"
        env = _env(**{MARKER_ENV: str(work / "marker")})
        p, cmd = _train(ctx, work, [f"reward.terms=[{{name: 'bench.reliability:{reward}'}}]", "run.steps=3",
                                    "reward.timeout_s=3", f"reward.isolation={isolation}"], run_dir, env=env,
                        timeout=150)
        steps = metrics_steps(run_dir)
        errors = sum(r.get("reward/errors", 0) for r in metrics_rows(run_dir))
        text = f"exit {p.rc}; steps {steps}; reward/errors {errors}; stderr: {tail(p.err, 400)}"
        if p.rc is None:
            return "hang", cmd, text, 0
        if "Traceback (most recent call last)" in p.err:
            return "traceback", cmd, f"{text}; {traceback_summary(p.err)}", 0
        if not (work / "marker").exists():
            return "failed", cmd, "the fault did not fire; " + text, 0
        ok = p.rc == 0 and steps == [0, 1, 2] and errors >= 1
        return ("survived" if ok else "failed"), cmd, text, len({0, 1, 2} - set(steps))

    return run


def fault_nan_rewards(ctx: Context, work: Path):
    run_dir = work / "run"
    p, cmd = _train(ctx, work, ["reward.terms=[{name: 'bench.reliability:nan_sometimes'}]", "run.steps=3"], run_dir)
    rows = metrics_rows(run_dir)
    means = [r.get("reward/mean") for r in rows]
    finite = all(isinstance(m, (int, float)) and m == m and abs(m) != float("inf") for m in means)
    errors = sum(r.get("reward/errors", 0) for r in rows)
    text = f"exit {p.rc}; reward/mean {means}; reward/errors {errors}; stderr: {tail(p.err, 300)}"
    if p.rc is None:
        return "hang", cmd, text, 0
    if "Traceback (most recent call last)" in p.err:
        return "traceback", cmd, f"{text}; {traceback_summary(p.err)}", 0
    ok = p.rc == 0 and [r["step"] for r in rows] == [0, 1, 2] and finite and errors >= 1
    return ("survived" if ok else "failed"), cmd, text, 0


def fault_nan_temperature(ctx: Context, work: Path):
    p, cmd = _train(ctx, work, ["rollout.sampling.temperature=.nan"], work / "run")
    outcome, why = _failed_with(p, (2,), "temperature=nan")
    if outcome == "survived" and (work / "run").exists():
        outcome, why = "failed", "refused, but after creating the run folder; " + why
    return outcome, cmd, why, 0


def _wait_for(predicate: Callable[[], bool], proc: subprocess.Popen, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def _sigterm_resume(mode: str):
    def run(ctx: Context, work: Path):
        run_dir = work / "run"
        # sync: long responses, so the signal lands while the engine generates (where most of a real run's
        # time goes); fully_async: the signal lands in the trainer's thread while a helper thread generates
        overrides = ([EVEN, "rollout.sampling.max_new_tokens=96"] if mode == "sync" else
                     [SLOW_EVEN, f"runtime.mode={mode}", *OFF_POLICY])
        args = ["train", str(RECIPE), *overrides, "run.steps=500", "--run-dir", str(run_dir), "--quiet"]
        cmd = ctx.display("tandem " + " ".join(_quote(a) for a in args))
        proc = launch(args, work)
        try:
            if not _wait_for(lambda: len(metrics_steps(run_dir)) >= 2, proc, 180):
                _kill_group(proc)
                _, err = proc.communicate()
                return "failed", cmd, f"no step completed; stderr: {tail(err)}", 0
            proc.send_signal(signal.SIGTERM)
            try:
                _, err = proc.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                _, err = proc.communicate()
                return "hang", cmd + "; kill -TERM", f"no exit within 120 s after SIGTERM; {tail(err)}", 0
        finally:
            if proc.poll() is None:
                _kill_group(proc)
                proc.wait()
        _save_log(work, args, proc.returncode, err)
        cmd += "; kill -TERM after >= 2 steps; tandem train ... run.steps=N+2 --resume RUN"
        n = len(metrics_steps(run_dir))
        problems = []  # (outcome, why), the worst first
        if "Traceback (most recent call last)" in err:
            problems.append(("traceback", f"a traceback on stderr after SIGTERM: {traceback_summary(err)}"))
        if proc.returncode != 128 + signal.SIGTERM or "saved checkpoint" not in err:
            problems.append(("failed", f"SIGTERM: exit {proc.returncode} (expected 143), last line "
                                       f"'{error_or_last(err)}'"))
        if not (run_dir / "checkpoints" / "LATEST").is_file():
            return "failed", cmd, "; ".join(why for _, why in problems) or "no checkpoint after SIGTERM", 0
        target = n + 2
        p, _ = _train(ctx, work, [*overrides, f"run.steps={target}"], run_dir, extra=["--resume", str(run_dir)],
                      timeout=180)
        steps = metrics_steps(run_dir)
        lost = len(set(range(target)) - set(steps))
        dup = len(steps) - len(set(steps))
        text = (f"SIGTERM after {n} steps: exit {proc.returncode}, '{error_or_last(err)}'; resume to {target}: exit "
                f"{p.rc}, metrics steps {steps}")
        if p.rc is None:
            return "hang", cmd, text, lost
        if lost:
            problems.insert(0, ("lost", f"{lost} steps missing"))
        if "Traceback (most recent call last)" in p.err:
            problems.append(("traceback", f"the resume: {traceback_summary(p.err)}"))
        if p.rc != 0 or dup:
            problems.append(("failed", f"the resume: exit {p.rc}, {dup} duplicate rows"))
        if problems:
            return problems[0][0], cmd, "; ".join(why for _, why in problems) + "; " + text, lost
        return "survived", cmd, text, 0

    return run


def error_or_last(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.startswith("tandem:")]
    return ctx_free(lines[-1] if lines else (err.strip().splitlines() or [""])[-1])


def ctx_free(text: str) -> str:
    return re.sub(r"/tmp/\S+?/\d{3}-[^/ ;]*", "WORK", text)


def _resume_after(damage: Callable[[Path], str], expect_log: list[str]):
    """Damage a copy of the base run, then resume it to 3 steps: every step in metrics.jsonl once."""
    def run(ctx: Context, work: Path):
        run_dir = ctx.copy_base(work / "run")
        what = damage(run_dir)
        p, cmd = _train(ctx, work, [EVEN, "run.steps=3", "run.save_every=1"], run_dir, extra=["--resume", str(run_dir)])
        steps = metrics_steps(run_dir)
        lost = len({0, 1, 2} - set(steps))
        bad_lines = sum(1 for line in (run_dir / "metrics.jsonl").read_text().splitlines() if not _json_ok(line))
        text = f"{what}; exit {p.rc}; metrics steps {steps}; bad lines {bad_lines}; stderr: {tail(p.err, 400)}"
        cmd = f"{what}; " + cmd
        if p.rc is None:
            return "hang", cmd, text, lost
        if "Traceback (most recent call last)" in p.err:
            return "traceback", cmd, f"{text}; {traceback_summary(p.err)}", lost
        if lost:
            return "lost", cmd, text, lost
        missing = [s for s in expect_log if s not in p.err]
        ok = p.rc == 0 and steps == [0, 1, 2] and not bad_lines and not missing
        return ("survived" if ok else "failed"), cmd, (f"log lacks {missing}; " if missing else "") + text, 0

    return run


def _json_ok(line: str) -> bool:
    try:
        json.loads(line)
    except ValueError:
        return False
    return True


def _flip_shard(run_dir: Path) -> str:
    shard = next((run_dir / "checkpoints" / "step_2" / "trainer").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 16):
        data[i] ^= 0xFF
    shard.write_bytes(bytes(data))
    return f"16 bytes flipped in checkpoints/step_2/trainer/{shard.name}"


def _delete_latest(run_dir: Path) -> str:
    shutil.rmtree(run_dir / "checkpoints" / "step_2")
    return "checkpoints/step_2 deleted (LATEST still names it)"


def _half_line(run_dir: Path) -> str:
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write('{"step": 2, "time": 10')
    return "a half-written last line appended to metrics.jsonl"


def fault_all_checkpoints_bad(ctx: Context, work: Path):
    run_dir = ctx.copy_base(work / "run")
    for step in (1, 2):
        state = run_dir / "checkpoints" / f"step_{step}" / "state.json"
        state.write_text(state.read_text().replace("{", "{ ", 1))
    before = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))
    p, cmd = _train(ctx, work, [EVEN, "run.steps=3"], run_dir, extra=["--resume", str(run_dir)])
    outcome, why = _failed_with(p, (2,), "--resume", "without a complete checkpoint")
    after = sorted(str(q.relative_to(run_dir)) for q in run_dir.rglob("*"))
    lost = len(set(before) - set(after))
    if outcome == "survived" and lost:
        outcome, why = "lost", f"{lost} files of the run were removed; {why}"
    return outcome, "state.json of step_1 and step_2 edited; " + cmd, why, lost


def fault_kill_engine(ctx: Context, work: Path):
    run_dir = work / "run"
    args = ["train", str(SEPARATE), SLOW_EVEN, "run.steps=500", "sync.timeout_s=60", "--run-dir", str(run_dir),
            "--quiet"]
    cmd = ctx.display("tandem " + " ".join(_quote(a) for a in args)) + "; kill -KILL <engine process> after step 1"
    proc = launch(args, work)
    try:
        if not _wait_for(lambda: len(metrics_steps(run_dir)) >= 1, proc, 180):
            _kill_group(proc)
            _, err = proc.communicate()
            return "failed", cmd, f"no step completed (exit {proc.returncode}); stderr: {tail(err)}", 0
        engines = [pid for pid in _children(proc.pid) if "engine_process_main" in _cmdline(pid)]
        if not engines:
            _kill_group(proc)
            proc.communicate()
            return "failed", cmd, f"no engine process among the children of {proc.pid}", 0
        os.kill(engines[0], signal.SIGKILL)
        killed = time.monotonic()
        try:
            _, err = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            _, err = proc.communicate()
            return "hang", cmd, f"the run did not stop within 90 s of the kill; stderr: {tail(err)}", 0
        took = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            _kill_group(proc)
            proc.wait()
    _save_log(work, args, proc.returncode, err)
    p = Proc(proc.returncode, "", err, took)
    outcome, why = _failed_with(p, (1, 2), "inference engine process", "SIGKILL")
    return outcome, cmd, f"stopped {took:.1f}s after the kill; " + why, 0


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def fault_hung_generate(ctx: Context, work: Path):
    p, cmd = _train(ctx, work, [EVEN, "rollout.generate=bench.reliability:hanging_generate", "runtime.watchdog_s=3",
                                "run.steps=2"], work / "run", timeout=120)
    outcome, why = _failed_with(p, (1,), "no training step completed", "runtime.watchdog_s=3")
    return outcome, cmd, f"{p.seconds:.1f}s; " + why, 0


def fault_export_user_folder(ctx: Context, work: Path):
    _user_folder(work)
    (work / "mine" / "sub").mkdir()
    (work / "mine" / "sub" / "data.bin").write_bytes(b"\x00" * 1000)
    before = {str(q.relative_to(work / "mine")): q.read_bytes() for q in (work / "mine").rglob("*") if q.is_file()}
    args = ["export", str(ctx.base), "mine"]
    p = tandem(args, work, 120)
    after = {str(q.relative_to(work / "mine")): q.read_bytes() for q in (work / "mine").rglob("*") if q.is_file()}
    lost = sum(1 for k, v in before.items() if after.get(k) != v)
    outcome, why = _failed_with(p, (2,), "refusing to replace", "--force")
    if lost:
        outcome = "lost"
    cmd = ctx.display("tandem " + " ".join(args))
    return outcome, cmd, f"{lost} of {len(before)} user files changed; " + ctx.display(why), lost


def fault_cases() -> list[FaultCase]:
    f = FaultCase
    return [
        f("reward always raises (sync)", "exit 1 after runtime.max_skipped_steps=3 steps, one line naming the "
          "reward's error; 3 metrics rows", fault_reward_always_raises, quick=True),
        f("reward always raises (fully_async)", "exit 1, one line naming the skip limit and the reward's error",
          fault_reward_always_raises_async),
        f("reward hangs once (threads, timeout_s=3)", "all 3 steps run, the call counted as a reward error, the "
          "process exits", _hang_or_exit_once("hangs_once", "thread"), quick=True),
        f("reward hangs once (processes, timeout_s=3)", "the worker is killed and replaced; all 3 steps, the process "
          "exits", _hang_or_exit_once("hangs_once", "process")),
        f("reward kills its worker process", "the worker is replaced, its samples fail; all 3 steps",
          _hang_or_exit_once("exits_once", "process")),
        f("reward returns NaN for some samples", "those samples fail; all 3 steps, reward/mean finite",
          fault_nan_rewards),
        f("NaN temperature", "refused at start-up (exit 2, one line), no run folder", fault_nan_temperature,
          quick=True),
        f("SIGTERM mid-run, then --resume (sync)", "exit 143 with a checkpoint; the resume completes every step: "
          "none missing from metrics.jsonl, none twice", _sigterm_resume("sync"), quick=True),
        f("SIGTERM mid-run, then --resume (fully_async)", "as in sync", _sigterm_resume("fully_async")),
        f("flipped bytes in a checkpoint shard, then --resume", "the shard is named, the resume falls back to "
          "step_1 and completes steps 0..2",
          _resume_after(_flip_shard, ["is corrupted", "using checkpoint"])),
        f("LATEST names a deleted checkpoint, then --resume", "falls back to step_1, completes steps 0..2",
          _resume_after(_delete_latest, ["does not exist"])),
        f("half-written last line of metrics.jsonl, then --resume", "the line is dropped; every line valid JSON, "
          "steps 0..2", _resume_after(_half_line, [])),
        f("every checkpoint corrupted, then --resume", "refused (exit 2, one line), nothing deleted",
          fault_all_checkpoints_bad),
        f("engine process killed mid-run (placement=separate)", "the run stops within seconds with one error line "
          "naming the engine process, no traceback, no hang", fault_kill_engine),
        f("generate function hangs (watchdog_s=3)", "exit 1 with the stuck phase named, within seconds",
          fault_hung_generate),
        f("tandem export onto a folder with user files", "refused without --force (exit 2, one line); every user "
          "file intact", fault_export_user_folder),
    ]


def run_faults(ctx: Context, quick: bool, only: re.Pattern | None = None) -> list[Outcome]:
    cases = [c for c in fault_cases() if (c.quick or not quick) and (only is None or only.search(c.name))]
    results = []
    for i, case in enumerate(cases, 1):
        work = ctx.workdir(case.name)
        t0 = time.monotonic()
        outcome, cmd, detail, lost = case.run(ctx, work)
        seconds = time.monotonic() - t0
        results.append(Outcome("faults", case.name, cmd, outcome, seconds, ctx_free(ctx.display(detail)), lost))
        _progress("faults", i, len(cases), case.name, outcome, seconds, results[-1].detail)
    return results
