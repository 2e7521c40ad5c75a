"""`bench/reliability.py`, shared pieces: constants, fault plug-ins, running commands, outcomes."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny" / "grpo-sync.yaml"
SEPARATE = ROOT / "recipes" / "tiny" / "grpo-separate.yaml"
EVEN = "reward.terms=[{name: 'tests.runtime.rewards:even_tokens'}]"
SLOW_EVEN = "reward.terms=[{name: 'tests.runtime.rewards:slow_even_tokens'}]"
OFF_POLICY = ["algorithm.off_policy.mode=tis", "runtime.max_staleness=1"]
ERROR_LINE = re.compile(r"^tandem(?: [\w-]+)?: error: ")
MARKER_ENV = "TANDEM_BENCH_MARKER"


# -- fault plug-ins (imported by path by the runs below) ------------------------------------------------------


def always_fails(sample) -> float:
    """A reward whose judge is unreachable."""
    raise RuntimeError("the judge is unreachable")


def _first_call() -> bool:
    """True exactly once across every process sharing $TANDEM_BENCH_MARKER (atomic file creation)."""
    try:
        os.close(os.open(os.environ[MARKER_ENV], os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def _even(sample) -> float:
    ids = sample.response_tokens
    return sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1)


def hangs_once(sample) -> float:
    """The first call (over all processes) never returns; the others score like ``even_tokens``."""
    if _first_call():
        time.sleep(10**6)
    return _even(sample)


def exits_once(sample) -> float:
    """The first call (over all processes) ends its process with exit code 3."""
    if _first_call():
        os._exit(3)
    return _even(sample)


def nan_sometimes(sample) -> float:
    """NaN for responses whose first token id is odd, else ``even_tokens``."""
    if sample.response_tokens and sample.response_tokens[0] % 2 == 1:
        return float("nan")
    return _even(sample)


async def hanging_generate(ctx, record, *, group_index: int, seed: int):
    """A generate function that never returns (a stuck tool call, a dead remote judge...)."""
    import asyncio

    await asyncio.sleep(3600)


# -- running things -------------------------------------------------------------------------------------------


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TANDEM_API_KEY"}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


@dataclass
class Proc:
    rc: int | None  # None: timed out (killed)
    out: str
    err: str
    seconds: float


def launch(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``python -m tandem.cli ARGS`` in ``cwd``, in its own process group, stdout/stderr piped."""
    return subprocess.Popen([sys.executable, "-m", "tandem.cli", *args], cwd=cwd, env=env or _env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def tandem(args: list[str], cwd: Path, timeout: float, env: dict[str, str] | None = None) -> Proc:
    """``python -m tandem.cli ARGS`` in ``cwd``; on timeout the process group is killed (rc None)."""
    start = time.monotonic()
    proc = launch(args, cwd, env)
    try:
        out, err = proc.communicate(timeout=timeout)
        rc: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, err = proc.communicate()
        rc = None
    return Proc(rc, out, err, time.monotonic() - start)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def metrics_steps(run_dir: Path) -> list[int]:
    """The ``step`` of every valid line of RUN_DIR/metrics.jsonl (bad lines skipped, as tandem does)."""
    p = run_dir / "metrics.jsonl"
    steps = []
    if p.is_file():
        for line in p.read_text(errors="replace").splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and type(row.get("step")) is int:
                steps.append(row["step"])
    return steps


def metrics_rows(run_dir: Path) -> list[dict]:
    p = run_dir / "metrics.jsonl"
    rows = []
    for line in p.read_text(errors="replace").splitlines() if p.is_file() else []:
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
    return [r for r in rows if isinstance(r, dict)]


def traceback_summary(text: str) -> str:
    """The lines before the first traceback, its last two frames and its exception line, on one line."""
    lines = text.splitlines()
    starts = [k for k, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    if not starts:
        return tail(text, 300)
    i = starts[0]
    j = next((k for k in range(i + 1, len(lines)) if lines[k] and not lines[k].startswith((" ", "Traceback"))),
             len(lines) - 1)
    frames = [line.strip() for line in lines[i:j] if line.strip().startswith("File ")][-2:]
    before = [line for line in lines[max(0, i - 2):i]
              if line.strip() and not re.match(r"(step |  return|\d{4}-\d\d-\d\d [\d:,]+ (INFO|WARNING) )", line)]
    return " / ".join([*before, "Traceback:", *frames, lines[j]])


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if ERROR_LINE.match(line)]


def tail(text: str, n: int = 600) -> str:
    text = text.strip()
    return text if len(text) <= n else "..." + text[-n:]


@dataclass
class Outcome:
    group: str
    name: str
    command: str
    outcome: str
    seconds: float
    detail: str = ""  # the actual output of a miss (or a note)
    data_lost: int = 0
    check: bool = False  # a check of the whole group (the server's log, its exit), not a case


class Context:
    """Shared state: the scratch folder and a finished 2-step run built once (checkpoints step_1, step_2)."""

    def __init__(self, scratch: Path) -> None:
        self.scratch = scratch
        self._base: Path | None = None
        self._n = 0

    def workdir(self, name: str) -> Path:
        self._n += 1
        d = self.scratch / f"{self._n:03d}-{re.sub(r'[^A-Za-z0-9]+', '-', name)[:40]}"
        d.mkdir(parents=True)
        return d

    @property
    def base(self) -> Path:
        if self._base is None:
            run_dir = self.scratch / "base-run"
            print("[setup] a 2-step tiny run with a checkpoint after each step (the base of several cases)",
                  file=sys.stderr, flush=True)
            p = tandem(["train", str(RECIPE), EVEN, "run.steps=2", "run.save_every=1", "--run-dir", str(run_dir),
                        "--quiet"], self.scratch, timeout=300)
            if p.rc != 0 or metrics_steps(run_dir) != [0, 1]:
                raise SystemExit(f"the base run failed (rc {p.rc}):\n{tail(p.err, 3000)}")
            self._base = run_dir
        return self._base

    def copy_base(self, dest: Path) -> Path:
        shutil.copytree(self.base, dest)
        return dest

    def display(self, text: str) -> str:
        """A command as a reader would type it: paths relative to the repository, the scratch folder named."""
        if self._base is not None:
            text = text.replace(str(self._base), "BASE_RUN")
        text = re.sub(re.escape(str(self.scratch)) + r"/\d{3}-[^/ ]*", "WORK", text)
        return text.replace(str(self.scratch), "SCRATCH").replace(str(ROOT) + "/", "")
