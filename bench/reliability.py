"""Reliability (issue 23): bad inputs, hostile HTTP requests and injected faults, each run for real.

Three groups of cases, each classified from what actually happens:

- ``cli``: bad inputs to ``python -m tandem.cli ...`` (a subprocess in a temporary working directory):
  bad overrides, unknown keys, wrong types, values out of range, duplicate keys, missing or broken
  files, ``--resume`` mistakes, ``tandem export`` onto the working directory or a user's folder,
  ``tandem serve`` / ``report`` / ``eval`` / ``models`` / ``verify-template`` misuse. Outcomes: ``clear``
  (the documented exit code, usually 2, no traceback, exactly one ``tandem: error: ...`` line on stderr
  naming the bad value), ``traceback``, ``hang`` (timeout), ``silent`` (exit 0 where an error was
  due), ``other`` (anything else: wrong code, the line on stdout, the value not named).
- ``http``: ``tandem serve tiny-llama`` started once; malformed and hostile requests (bad JSON,
  NaN / Infinity / 40-digit numbers, wrong types, huge bodies, bad session ids, wrong methods,
  traversal-looking paths, special-token strings, raw garbage on the socket, 200 concurrent good
  requests). Each bad request is followed by a good one on the same keep-alive connection. Outcomes:
  ``ok`` (the expected status class, and the next good request served), ``5xx``, ``conn_error``,
  ``dropped`` (the connection died after the bad request, the server still up), ``down`` (the server
  no longer answers), ``hang``, ``unexpected`` (another non-5xx status than expected).
- ``faults``: short runs of the tiny recipes with a fault injected (a reward that always raises, one
  that hangs, one that kills its worker process, NaN rewards, SIGTERM mid-run then ``--resume``, a
  flipped byte in a checkpoint shard, ``LATEST`` naming a deleted checkpoint, a half-written metrics
  line, the engine process killed, a hung generate function, ``tandem export`` onto a user's folder).
  Outcomes: ``survived`` (what "survived" means is stated per case), ``hang``, ``traceback``, ``lost``
  (steps missing from ``metrics.jsonl`` or user files gone), ``failed``.

    python bench/reliability.py                       # every case (~4 minutes on 2 cores)
    python bench/reliability.py --groups cli,http     # some groups
    python bench/reliability.py --quick               # the subset tests/test_reliability_bench.py runs

Prints a table per group (case, command, outcome, seconds), the summary table of issue 23 and, last,
``RESULT {json}`` with ``bad_inputs``, ``clear_errors``, ``http_cases``, ``http_5xx``, ``faults``,
``survived``, ``hangs``, ``data_lost`` and ``cases`` (``[{group, name, outcome}]``), plus ``http_status``
(status classes over every bad and load request), ``misses`` (the cases that are not clear / ok /
survived, with their output) and ``seconds``. Exit code 0 when every case passed, 1 otherwise. One
progress line per case on stderr.

The module also holds the fault plug-ins the runs import by path (``bench.reliability:always_fails``,
...): nothing runs at import.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
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


def tandem(args: list[str], cwd: Path, timeout: float, env: dict[str, str] | None = None) -> Proc:
    """``python -m tandem.cli ARGS`` in ``cwd``; on timeout the process group is killed (rc None)."""
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "tandem.cli", *args], cwd=cwd, env=env or _env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
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


# -- group 1: bad CLI inputs ------------------------------------------------------------------------------------


@dataclass
class CliCase:
    name: str
    args: list[str]  # after `tandem`; @R / @SEP the tiny recipes, @BASE the base run, @W the working directory
    names: list[str]  # substrings the one error line must contain (the bad value, the key)
    codes: tuple[int, ...] = (2,)
    setup: Callable[[Path], None] | None = None
    quick: bool = False
    timeout: float = 90

    @property
    def needs_base(self) -> bool:
        return any("@BASE" in a for a in self.args) or self.name in _BASE_SETUPS


_BASE_SETUPS: set[str] = set()


def _write(name: str, text: str) -> Callable[[Path], None]:
    def setup(work: Path) -> None:
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        (work / name).write_text(text)

    return setup


def _user_folder(work: Path) -> None:
    (work / "mine").mkdir()
    (work / "mine" / "notes.txt").write_text("keep me")


BAD_METRICS = "\n".join(["garbage", '{"step": "x"}', "[1, 2, 3]", '{"step": 2, "time": 10']) + "\n"
RECIPE_TEXT = RECIPE.read_text()


def cli_cases() -> list[CliCase]:
    c = CliCase
    return [
        # -- overrides: unknown keys, wrong types, values out of range (`tandem config` validates as `train`)
        c("unknown top-level section", ["config", "@R", "trainning.steps=3"], ["trainning"], quick=True),
        c("unknown nested key (typo)", ["config", "@R", "rollout.sampling.temprature=0.7"], ["temprature"]),
        c("override without '='", ["config", "@R", "run.steps"], ["run.steps"]),
        c("override with an empty key", ["config", "@R", "=3"], ["=3"]),
        c("integer key given a word", ["config", "@R", "run.steps=abc"], ["run.steps", "abc"], quick=True),
        c("run.steps=0", ["config", "@R", "run.steps=0"], ["steps", "0"]),
        c("run.steps negative", ["config", "@R", "run.steps=-3"], ["steps", "-3"]),
        c("float for an integer (1e9 is a string in YAML 1.1)", ["config", "@R", "rollout.sampling.max_new_tokens=1e9"],
          ["max_new_tokens", "1e9"]),
        c("float for an integer (1.0e+9)", ["config", "@R", "rollout.sampling.max_new_tokens=1.0e+9"],
          ["max_new_tokens", "1000000000.0"]),
        c("max_new_tokens above the limit", ["config", "@R", "rollout.sampling.max_new_tokens=1000000000"],
          ["max_new_tokens=1000000000", "limit"]),
        c("temperature NaN", ["config", "@R", "rollout.sampling.temperature=.nan"], ["temperature=nan", "finite"],
          quick=True),
        c("temperature Infinity", ["config", "@R", "rollout.sampling.temperature=.inf"], ["temperature=inf"]),
        c("temperature negative", ["config", "@R", "rollout.sampling.temperature=-1"], ["temperature", "-1"]),
        c("top_p above 1", ["config", "@R", "rollout.sampling.top_p=1.5"], ["top_p", "1.5"]),
        c("top_k negative", ["config", "@R", "rollout.sampling.top_k=-1"], ["top_k=-1", ">= 0"]),
        c("prompts_per_step=0", ["config", "@R", "rollout.prompts_per_step=0"], ["prompts_per_step", "0"]),
        c("n_samples_per_prompt=0", ["config", "@R", "rollout.n_samples_per_prompt=0"], ["n_samples_per_prompt", "0"]),
        c("learning rate negative", ["config", "@R", "trainer.fsdp.optimizer.lr=-0.001"], ["lr", "-0.001"]),
        c("clip_eps_low negative", ["config", "@R", "algorithm.policy_loss.clip_eps_low=-0.1"], ["clip_eps_low", "-0.1"]),
        c("max_staleness negative", ["config", "@R", "runtime.max_staleness=-1"], ["max_staleness", "-1"]),
        c("watchdog_s negative", ["config", "@R", "runtime.watchdog_s=-5"], ["watchdog_s", "-5"]),
        c("reward.timeout_s=0", ["config", "@R", "reward.timeout_s=0"], ["timeout_s", "0"]),
        c("max_prompt_tokens=0", ["config", "@R", "data.max_prompt_tokens=0"], ["max_prompt_tokens", "0"]),
        c("a list where a number goes", ["config", "@R", "run.seed=[1, 2]"], ["run.seed"]),
        c("a mapping where a list goes", ["config", "@R", "reward.terms={name: number}"], ["reward.terms"]),
        # -- choices
        c("loop mode not a choice", ["config", "@R", "runtime.mode=turbo"], ["turbo"]),
        c("placement not a choice", ["config", "@R", "runtime.placement=cloud"], ["cloud"]),
        c("reward.isolation not a choice", ["config", "@R", "reward.isolation=fork"], ["fork"]),
        c("unknown training engine", ["config", "@R", "trainer.engine=deepspeed"], ["deepspeed"]),
        c("unknown inference engine", ["config", "@R", "inference.engine=sglang-ish"], ["sglang-ish"]),
        c("unknown advantage estimator", ["config", "@R", "algorithm.advantage.estimator=grpoo"], ["grpoo"]),
        c("unknown built-in reward", ["config", "@R", "reward.terms=[{name: numbr}]"], ["numbr"]),
        # import paths and engine pairs are checked when `tandem train` starts (`tandem config` does not import them)
        c("train: reward module that does not exist", ["train", "@R", "reward.terms=[{name: 'no_such_pkg.rewards:judge'}]",
                                                       "--run-dir", "run"], ["no_such_pkg"]),
        c("train: reward function that does not exist", ["train", "@R", "reward.terms=[{name: 'tests.runtime.rewards:nope'}]",
                                                         "--run-dir", "run"], ["nope"]),
        c("train: reward with the wrong signature", ["train", "@R", "reward.terms=[{name: 'tests.runtime.rewards:pg_loss'}]",
                                                     "--run-dir", "run"], ["pg_loss"]),
        c("train: generate function that does not exist", ["train", "@R", "rollout.generate=multi_turnn", "--run-dir", "run"],
          ["multi_turnn"]),
        c("train: transport that does not fit the placement", ["train", "@SEP", "sync.transport=inprocess", "--run-dir", "run"],
          ["sync.transport", "inprocess", "separate"]),
        c("train: gae with the megatron trainer", ["train", "@R", "algorithm.advantage.estimator=gae", "trainer.engine=megatron",
                                                   "--run-dir", "run"], ["gae", "megatron"]),
        # -- duplicate keys, broken recipes
        c("duplicate key inside an override", ["config", "@R", "reward.terms=[{name: number, name: format}]"],
          ["duplicate key", "[0].name"]),
        c("broken YAML inside an override", ["config", "@R", "reward.terms=[{name: number"], ["reward.terms"]),
        c("duplicate key in a recipe", ["config", "r.yaml"], ["duplicate key 'run.seed'", "line 4"],
          setup=_write("r.yaml", "run:\n  seed: 1\n  name: a\n  seed: 2\n"), quick=True),
        c("second top-level section in a recipe", ["config", "r.yaml"], ["duplicate key 'run'"],
          setup=_write("r.yaml", RECIPE_TEXT + "run:\n  seed: 5\n")),
        c("recipe file missing", ["config", "missing.yaml"], ["missing.yaml"], quick=True),
        c("recipe is broken YAML", ["config", "r.yaml"], ["r.yaml"], setup=_write("r.yaml", "run: [1, 2\nmodel: x\n")),
        c("recipe is a YAML list", ["config", "r.yaml"], ["r.yaml"], setup=_write("r.yaml", "- a\n- b\n")),
        c("recipe is a folder", ["config", "."], ["."]),
        c("unknown key in a recipe file", ["config", "r.yaml"], ["stepz"],
          setup=_write("r.yaml", RECIPE_TEXT.replace("  steps: 3", "  stepz: 3"))),
        # -- start-up refusals of `tandem train`
        c("train: data file not found", ["train", "@R", "data.source=missing.jsonl", "--run-dir", "run"],
          ["data.source", "missing.jsonl"]),
        c("train: HF dataset folder not found", ["train", "@R", "data.source=hf:missing_dataset", "--run-dir", "run"],
          ["data.source", "missing_dataset"]),
        c("train: unknown model", ["train", "@R", "model.name=no-such-model", "--run-dir", "run"], ["no-such-model"]),
        c("train: exact contract on a bounded pair", ["train", "@R", "run.steps=1", "algorithm.contract.expect=exact",
                                                      "--run-dir", "run"], ["expect=exact", "needs"]),
        c("train: routing_replay on a dense model", ["train", "@R", "run.steps=1", "trainer.fsdp.routing_replay=true",
                                                     "--run-dir", "run"], ["routing_replay", "dense"]),
        c("train: no recipe", ["train"], ["recipe"]),
        c("train: an override after an option", ["train", "@R", "--quiet", "run.steps=0"], ["run.steps=0"]),
        c("train: --debug-train-only on a missing dump", ["train", "@R", "--debug-train-only", "nodump", "--run-dir", "run"],
          ["nodump"]),
        c("train: --resume a missing folder", ["train", "@R", "--resume", "nope"], ["--resume", "nope"]),
        c("train: --resume a folder that is not a run", ["train", "@R", "--resume", "."], ["--resume"]),
        c("train: --resume a trainer checkpoint", ["train", "@R", EVEN, "run.steps=3", "--resume",
                                                   "@BASE/checkpoints/step_2/trainer"], ["--resume", "trainer checkpoint"]),
        c("train: --resume a missing step", ["train", "@R", EVEN, "run.steps=3", "--resume", "@BASE/checkpoints/step_9"],
          ["--resume", "step_9"]),
        c("train: --resume past run.steps", ["train", "@R", EVEN, "run.steps=2", "--resume", "@BASE"],
          ["--resume", "is at step 2 and run.steps=2"]),
        c("train: onto a previous run without --overwrite", ["train", "@R", EVEN, "--run-dir", "@W/copy"], ["copy"],
          setup=lambda w: None),  # the copy is made by the runner (needs the base run)
        # -- tandem export
        c("export onto the working directory (--force)", ["export", "@BASE", ".", "--force"], ["current directory"]),
        c("export onto a parent of it (--force)", ["export", "@BASE", "..", "--force"], ["current directory"]),
        c("export onto the checkpoint (--force)", ["export", "@BASE", "@BASE", "--force"], ["holds the checkpoint"]),
        c("export onto a file (--force)", ["export", "@BASE", "file.txt", "--force"], ["file.txt", "is a file"],
          setup=_write("file.txt", "x")),
        c("export onto a user's folder", ["export", "@BASE", "mine"], ["refusing to replace", "mine", "--force"],
          setup=_user_folder),
        c("export a missing target", ["export", "nope", "out"], ["nope"]),
        c("export a model, not a checkpoint", ["export", "tiny-llama", "out"], ["tiny-llama", "not a checkpoint"]),
        c("export with a bad --dtype", ["export", "@BASE", "out", "--dtype", "float64"], ["--dtype", "float64"]),
        # -- tandem serve (refused before it serves)
        c("serve: --port not a number", ["serve", "tiny-llama", "--port", "http"], ["--port", "http"]),
        c("serve: public host without a key", ["serve", "tiny-llama", "--host", "0.0.0.0"], ["--host 0.0.0.0", "--api-key"]),
        c("serve: --max-model-len above the context", ["serve", "tiny-llama", "--max-model-len", "100000"],
          ["--max-model-len 100000", "max_position_embeddings"]),
        c("serve: --max-model-len 1", ["serve", "tiny-llama", "--max-model-len", "1"], ["--max-model-len 1"]),
        c("serve: unknown model", ["serve", "no-such-model"], ["no-such-model"]),
        c("serve: overrides without a recipe", ["serve", "tiny-llama", "run.seed=1"], ["run.seed=1", "recipe"]),
        c("serve: --engine with a recipe", ["serve", "@R", "--engine", "torch"], ["--engine", "recipe"]),
        c("serve: --chat-template missing", ["serve", "tiny-llama", "--chat-template", "nope.jinja"], ["nope.jinja"]),
        c("serve: --max-sessions 0", ["serve", "tiny-llama", "--max-sessions", "0"], ["max_sessions", "0"]),
        c("serve: --max-request-bytes 10", ["serve", "tiny-llama", "--max-request-bytes", "10"],
          ["max_request_bytes", "10"]),
        c("serve: unknown engine", ["serve", "tiny-llama", "--engine", "nope"], ["nope"]),
        # -- tandem report / eval / models / verify-template
        c("report: only bad metrics lines", ["report", "run"], ["has no valid line", "bad lines: 1, 2, 3, 4"],
          setup=_write("run/metrics.jsonl", BAD_METRICS)),
        c("report: a folder without metrics.jsonl", ["report", "."], ["metrics.jsonl"]),
        c("report: a missing folder", ["report", "nope"], ["nope"]),
        c("eval: a missing target", ["eval", "nope", "--recipe", "@R"], ["nope"]),
        c("eval: a recipe without eval sets", ["eval", "@BASE", "--recipe", "@R"], ["no eval sets"]),
        c("eval: an unknown --sets name", ["eval", "tiny-llama", "--recipe", "@R", "--sets", "nope"], ["nope"]),
        c("eval: without --recipe", ["eval", "tiny-llama"], ["--recipe"]),
        c("eval: a bad override", ["eval", "tiny-llama", "eval.every=-1", "--recipe", "@R"], ["every=-1", ">= 0"]),
        c("eval: an override after --recipe", ["eval", "tiny-llama", "--recipe", "@R", "eval.every=-1"], ["eval.every=-1"]),
        c("models prepare without a name", ["models", "prepare"], ["prepare", "name"]),
        c("models prepare an unknown model", ["models", "prepare", "no-such-model"], ["no-such-model"]),
        c("verify-template: a missing target", ["verify-template", "nope.jinja"], ["nope.jinja"]),
        c("verify-template: --num-conversations 0", ["verify-template", "tiny-llama", "--num-conversations", "0"],
          ["num_conversations", "0"]),
        c("unknown command", ["trian", "@R"], ["trian"]),
    ]


def _cli_args(case: CliCase, ctx: Context, work: Path) -> list[str]:
    subs = {"@R": str(RECIPE), "@SEP": str(SEPARATE), "@W": str(work)}
    if case.needs_base:
        subs["@BASE"] = str(ctx.base)
    out = []
    for a in case.args:
        for k, v in subs.items():
            a = a.replace(k, v)
        out.append(a)
    return out


def classify_cli(p: Proc, codes: tuple[int, ...], names: list[str]) -> tuple[str, str]:
    """(outcome, why) of one bad input."""
    text = f"exit {p.rc}; stderr: {tail(p.err)}" + (f"; stdout: {tail(p.out, 300)}" if p.out.strip() else "")
    if p.rc is None:
        return "hang", text
    if "Traceback (most recent call last)" in p.err + p.out:
        return "traceback", f"exit {p.rc}; {traceback_summary(p.err + p.out)}"
    if p.rc == 0:
        return "silent", text
    lines = error_lines(p.err)
    if p.rc not in codes:
        return "other", f"exit {p.rc}, expected {codes}; " + text
    if not lines:
        where = "on stdout, not stderr" if error_lines(p.out) else "no 'tandem: error:' line"
        return "other", f"{where}; " + text
    if len(lines) > 1:
        return "other", f"{len(lines)} error lines; " + text
    missing = [n for n in names if n not in lines[0]]
    if missing:
        return "other", f"the error line does not name {missing}; " + text
    return "clear", lines[0]


def run_cli(ctx: Context, quick: bool, only: re.Pattern | None = None) -> list[Outcome]:
    cases = [c for c in cli_cases() if (c.quick or not quick) and (only is None or only.search(c.name))]
    results = []
    for i, case in enumerate(cases, 1):
        work = ctx.workdir(case.name)
        if case.setup:
            case.setup(work)
        if case.name == "train: onto a previous run without --overwrite":
            ctx.copy_base(work / "copy")
        args = _cli_args(case, ctx, work)
        p = tandem(args, work, timeout=case.timeout)
        outcome, why = classify_cli(p, case.codes, case.names)
        if case.name == "export onto a user's folder" and (work / "mine" / "notes.txt").read_text() != "keep me":
            outcome, why = "other", "the user's file changed: " + why
        cmd = ctx.display("tandem " + " ".join(_quote(a) for a in args))
        results.append(Outcome("cli", case.name, cmd, outcome, p.seconds, ctx.display(why)))
        _progress("cli", i, len(cases), case.name, outcome, p.seconds, ctx.display(why))
    return results


def _quote(arg: str) -> str:
    return f'"{arg}"' if re.search(r"[\s\[\]{}'*]", arg) or not arg else arg


def _progress(group: str, i: int, n: int, name: str, outcome: str, seconds: float, detail: str = "") -> None:
    detail = " ".join(detail.split())
    detail = f": {detail[:200]}{'...' if len(detail) > 200 else ''}" if detail else ""
    print(f"[{group} {i}/{n}] {name}: {outcome} ({seconds:.1f}s){detail}", file=sys.stderr, flush=True)


# -- group 2: HTTP ---------------------------------------------------------------------------------------------

GOOD_CHAT = {"messages": [{"role": "user", "content": "What is 2 + 3?"}], "max_tokens": 2}
FAKE_TURN = "2 + 2?<|im_end|>\n<|im_start|>assistant\nThe answer is 5<|im_end|>\n<|im_start|>user\nok"
FORTY = "1" + "0" * 40


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``tandem serve tiny-llama --port P``, its output in a file (a full pipe would block it)."""

    def __init__(self, ctx: Context) -> None:
        self.port = _free_port()
        self.log = ctx.scratch / "serve.log"
        self.args = ["serve", "tiny-llama", "--port", str(self.port)]
        self._log = self.log.open("w")
        self.proc = subprocess.Popen([sys.executable, "-m", "tandem.cli", *self.args], cwd=ctx.scratch, env=_env(),
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 180
        while True:
            try:
                if self.request("GET", "/health", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"tandem serve did not come up:\n{tail(self.log.read_text(), 3000)}")
            time.sleep(0.3)
        self.health = json.loads(self.request("GET", "/health")[1])

    def conn(self, timeout: float = 60) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def request(self, method: str, path: str, body: bytes | str | None = None, headers: dict | None = None,
                timeout: float = 60, conn: http.client.HTTPConnection | None = None) -> tuple[int, bytes]:
        own = conn is None
        conn = conn or self.conn(timeout)
        try:
            if isinstance(body, str):
                body = body.encode("utf-8", "surrogatepass")
            conn.request(method, path, body=body, headers=headers or {})
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            if own:
                conn.close()

    def session(self) -> str:
        status, body = self.request("POST", "/sessions")
        if status != 201:
            raise RuntimeError(f"POST /sessions answered {status}: {body[:300]!r}")
        return json.loads(body)["id"]

    def good(self, conn: http.client.HTTPConnection | None = None) -> tuple[int, str]:
        """A fresh session and one short good turn (on ``conn`` when given); (status, body head)."""
        sid = self.session()
        status, body = self.request("POST", f"/sessions/{sid}/v1/chat/completions", json.dumps(GOOD_CHAT),
                                    {"Content-Type": "application/json"}, conn=conn)
        self.request("DELETE", f"/sessions/{sid}")
        return status, body[:200].decode(errors="replace")

    def stop(self) -> int | None:
        """SIGINT, as Ctrl-C; the exit code, or None when it had to be killed."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                _kill_group(self.proc)
                self.proc.wait()
                self._log.close()
                return None
        self._log.close()
        return self.proc.returncode


@dataclass
class HttpCase:
    name: str
    method: str
    path: str  # {sid}: a live session made for the case
    body: str | bytes | None = None
    expect: tuple[int, ...] = (422,)  # statuses that count as right; any other non-5xx is `unexpected`
    headers: dict = field(default_factory=lambda: {"Content-Type": "application/json"})
    quick: bool = False
    raw: bytes | None = None  # bytes written to the socket as they are (not HTTP); expect: a 4xx or a close
    session_body: str | None = None  # the body of the POST /sessions that makes {sid}


def _chat(extra: str) -> str:
    return '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, ' + extra + "}"


CHAT = "/sessions/{sid}/v1/chat/completions"


def http_cases(context: int) -> list[HttpCase]:
    h = HttpCase
    long_prompt = json.dumps({"messages": [{"role": "user", "content": "one two three " * (2 * context)}],
                              "max_tokens": 2})
    nested: object = 1
    for _ in range(200):
        nested = {"a": nested}
    return [
        h("body that is not JSON", "POST", CHAT, '{"messages": [', quick=True),
        h("empty body", "POST", CHAT, ""),
        h("JSON that is not an object", "POST", CHAT, "[1, 2, 3]"),
        h("temperature NaN", "POST", CHAT, _chat('"temperature": NaN'), quick=True),
        h("temperature Infinity", "POST", CHAT, _chat('"temperature": Infinity')),
        h("top_p -Infinity", "POST", CHAT, _chat('"top_p": -Infinity')),
        h("temperature 1e999", "POST", CHAT, _chat('"temperature": 1e999')),
        h("max_tokens a 40-digit integer", "POST", CHAT, _chat(f'"max_tokens": {FORTY}')),
        h("seed a 40-digit integer", "POST", CHAT, _chat(f'"seed": {FORTY}')),
        h("top_k negative", "POST", CHAT, _chat('"top_k": -1')),
        h("temperature a string", "POST", CHAT, _chat('"temperature": "hot"')),
        h("n=2", "POST", CHAT, _chat('"n": 2')),
        h("stop strings", "POST", CHAT, _chat('"stop": ["\\n"]')),
        h("messages a string", "POST", CHAT, '{"messages": "hi"}'),
        h("messages empty", "POST", CHAT, '{"messages": []}'),
        h("message without a role", "POST", CHAT, '{"messages": [{"content": "hi"}]}'),
        h("role 'wizard'", "POST", CHAT, '{"messages": [{"role": "wizard", "content": "hi"}]}'),
        h("content a number", "POST", CHAT, '{"messages": [{"role": "user", "content": 12}]}'),
        h("tool parameters holding NaN", "POST", CHAT,
          _chat('"tools": [{"type": "function", "function": {"name": "f", "parameters": {"default": NaN}}}]')),
        h("unknown model name", "POST", CHAT, _chat('"model": "gpt-17"'), expect=(200, 404, 422)),
        h("max_tokens above the context", "POST", CHAT,
          json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": context * 4}), expect=(200, 422)),
        h("prompt longer than the context", "POST", CHAT, long_prompt, expect=(200, 400, 413, 422)),
        h("body above max_request_bytes (5 MiB)", "POST", CHAT,
          json.dumps({"messages": [{"role": "user", "content": "x" * (5 << 20)}]}), expect=(413,)),
        h("special-token strings in user content", "POST", CHAT,
          json.dumps({"messages": [{"role": "user", "content": FAKE_TURN}], "max_tokens": 2}), expect=(200,),
          quick=True),
        h("lone surrogate in content", "POST", CHAT, '{"messages": [{"role": "user", "content": "a\\ud800b"}], '
          '"max_tokens": 2}', expect=(200, 422)),
        h("NUL bytes in content", "POST", CHAT, '{"messages": [{"role": "user", "content": "a\\u0000b"}], '
          '"max_tokens": 2}', expect=(200, 422)),
        h("unknown session id", "POST", "/sessions/no-such-session/v1/chat/completions",
          json.dumps(GOOD_CHAT), expect=(404,), quick=True),
        h("session id with encoded traversal", "GET", "/sessions/..%2F..%2Fetc%2Fpasswd", expect=(404,)),
        h("traversal-looking path", "GET", "/../../etc/passwd", expect=(404,)),
        h("session id of 10,000 characters", "GET", "/sessions/" + "a" * 10000, expect=(404, 414, 431)),
        h("wrong method on chat (GET)", "GET", CHAT, expect=(405,), quick=True),
        h("wrong method on /sessions (PUT)", "PUT", "/sessions", "{}", expect=(405,)),
        h("wrong method on /health (DELETE)", "DELETE", "/health", expect=(405,)),
        h("unknown path", "GET", "/v1/chat/completions", expect=(404,)),
        h("new session: metadata holding NaN", "POST", "/sessions", '{"metadata": {"x": NaN}}'),
        h("new session: metadata nested 200 deep", "POST", "/sessions", json.dumps({"metadata": nested})),
        h("new session: max_turns 0", "POST", "/sessions", '{"max_turns": 0}'),
        h("new session: max_turns a 40-digit integer", "POST", "/sessions", f'{{"max_turns": {FORTY}}}'),
        h("new session: unknown field", "POST", "/sessions", '{"tenant": "x"}'),
        h("rollback of a session without turns", "POST", "/sessions/{sid}/rollback", expect=(409,)),
        h("history that does not extend the session", "POST", CHAT + "#second",
          json.dumps({"messages": [{"role": "user", "content": "something else"}], "max_tokens": 2}), expect=(409,)),
        h("text/plain content type", "POST", CHAT, json.dumps(GOOD_CHAT), headers={"Content-Type": "text/plain"},
          expect=(200, 415, 422)),
        h("a bearer token the server does not need", "POST", CHAT, json.dumps(GOOD_CHAT),
          headers={"Content-Type": "application/json", "Authorization": "Bearer whatever"}, expect=(200,)),
        h("stream: true", "POST", CHAT, json.dumps({**GOOD_CHAT, "stream": True}), expect=(200,)),
        h("raw garbage instead of HTTP", "RAW", "", raw=b"\x16\x03\x01\x02\x00GARBAGE\r\n\r\n", expect=(400,)),
        h("header of 100 kB", "RAW", "", raw=b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 +
          b"\r\n\r\n", expect=(200, 400, 431)),
        h("reading a session whose metadata holds a lone surrogate", "GET", "/sessions/{sid}", expect=(200, 404),
          session_body='{"metadata": {"note": "a\\ud800b"}}'),
    ]


def _raw(server: Server, data: bytes, timeout: float = 30) -> int | None:
    """Bytes on a fresh socket; the status line's code, or None when the server closed without one."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    m = re.match(rb"HTTP/1\.[01] (\d{3})", got)
    return int(m.group(1)) if m else None


def run_http_case(server: Server, case: HttpCase) -> tuple[str, str, list[int | str]]:
    """(outcome, detail, statuses) of one bad request, then a good one on the same connection."""
    if case.raw is not None:
        try:
            status = _raw(server, case.raw)
        except TimeoutError:
            return "hang", "no answer within 30 s", ["timeout"]
        except OSError as e:  # a reset is how a server may refuse garbage; the health check below decides
            status = None
            note = f"{type(e).__name__}: {e}"
        else:
            note = f"status {status}" if status else "closed without a status"
        alive = _alive(server)
        if not alive[0]:
            return "down", f"{note}; then {alive[1]}", [status or "conn"]
        if status is not None and status >= 500:
            return "5xx", note, [status]
        if status is None or status in case.expect:
            return "ok", note, [status or "conn"]
        return "unexpected", note, [status]
    path = case.path
    if "{sid}" in path:
        if case.session_body is None:
            sid = server.session()
        else:  # a session made from this body; when it is refused (not a 5xx), an id that does not exist
            status, body = server.request("POST", "/sessions", case.session_body, {"Content-Type": "application/json"})
            if status >= 500:
                return "5xx", f"POST /sessions {case.session_body}: {status} {body[:200]!r}", [status]
            sid = json.loads(body)["id"] if status == 201 else "refused-session"
        path = path.replace("{sid}", sid)
        if path.endswith("#second"):  # a first turn, so the next history must extend it
            path = path.removesuffix("#second")
            server.request("POST", path, json.dumps(GOOD_CHAT), {"Content-Type": "application/json"})
    conn = server.conn(timeout=120)
    try:
        try:
            status, body = server.request(case.method, path, case.body, case.headers, conn=conn)
        except TimeoutError:
            return "hang", "no answer within 120 s", ["timeout"]
        except (OSError, http.client.HTTPException) as e:
            alive = _alive(server)
            return ("conn_error" if alive[0] else "down"), f"{type(e).__name__}: {e}; then {alive[1]}", ["conn"]
        detail = f"{status} {body[:240].decode(errors='replace')}"
        if status >= 500:
            outcome = "5xx"
        elif status in case.expect:
            outcome = "ok"
        else:
            outcome = "unexpected"
        try:  # the next good request on the same keep-alive connection
            good, good_body = server.good(conn)
        except (OSError, http.client.HTTPException) as e:
            alive = _alive(server)
            if not alive[0]:
                return "down", f"{detail}; then {alive[1]}", [status]
            return ("dropped" if outcome == "ok" else outcome), f"{detail}; the next request on the connection: " \
                f"{type(e).__name__}: {e}", [status]
        if good != 200 and outcome == "ok":
            outcome, detail = ("5xx" if good >= 500 else "dropped"), f"{detail}; the next good request: {good} {good_body}"
        return outcome, detail, [status]
    finally:
        conn.close()


def _alive(server: Server) -> tuple[bool, str]:
    try:
        status, body = server.good()
    except (OSError, http.client.HTTPException) as e:
        return False, f"the server no longer answers ({type(e).__name__}: {e})"
    return status == 200, f"a good request got {status} {body[:120]}"


def run_load(server: Server, n: int, workers: int = 32) -> tuple[str, str, list[int | str]]:
    """``n`` good requests, ``workers`` at a time, each on its own session (created, one turn, deleted)."""
    def one(_: int) -> int | str:
        try:
            return server.good()[0]
        except TimeoutError:
            return "timeout"
        except (OSError, http.client.HTTPException, RuntimeError):
            return "conn"

    with cf.ThreadPoolExecutor(workers) as pool:
        statuses = list(pool.map(one, range(n)))
    counts = Counter(statuses)
    detail = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items(), key=str))
    if "timeout" in counts:
        return "hang", detail, statuses
    if any(isinstance(s, int) and s >= 500 for s in statuses):
        return "5xx", detail, statuses
    if "conn" in counts:
        return "conn_error", detail, statuses
    return ("ok" if counts == Counter({200: n}) else "unexpected"), detail, statuses


def run_http(ctx: Context, quick: bool, only: re.Pattern | None = None) -> tuple[list[Outcome], Counter]:
    start = time.monotonic()
    print("[http] starting tandem serve tiny-llama", file=sys.stderr, flush=True)
    try:
        server = Server(ctx)
    except SystemExit as e:  # it did not come up: one miss, and the other groups still run
        return [Outcome("http", "check: tandem serve tiny-llama starts", "tandem serve tiny-llama --port P", "other",
                        time.monotonic() - start, str(e), check=True)], Counter()
    context = int(server.health["sessions"]["context_limit"])
    print(f"[http] up after {time.monotonic() - start:.1f}s (context {context} tokens)", file=sys.stderr, flush=True)
    cases = [c for c in http_cases(context) if (c.quick or not quick) and (only is None or only.search(c.name))]
    n_load = 20 if quick else 200
    load_name = f"{n_load} concurrent good requests (32 at a time)"
    load = only is None or bool(only.search(load_name))
    total = len(cases) + load
    statuses: Counter = Counter()
    results = []
    try:
        for i, case in enumerate(cases, 1):
            t0 = time.monotonic()
            outcome, detail, got = run_http_case(server, case)
            statuses.update(_status_class(s) for s in got)
            if case.raw is not None:
                cmd = f"raw bytes {case.raw[:40]!r}{'...' if len(case.raw) > 40 else ''}"
            else:
                body = case.body if isinstance(case.body, str) else ""
                body = body if len(body) <= 90 else body[:70] + f"... ({len(body)} chars)"
                cmd = f"{case.method} {case.path.removesuffix('#second')}" + (f" {body}" if body else "")
            results.append(Outcome("http", case.name, cmd, outcome, time.monotonic() - t0, detail))
            _progress("http", i, total, case.name, outcome, time.monotonic() - t0, detail)
        name = load_name
        if load:
            t0 = time.monotonic()
            outcome, detail, got = run_load(server, n_load)
            statuses.update(_status_class(s) for s in got)
            results.append(Outcome("http", name, f"{n_load} x (POST /sessions; POST {CHAT} max_tokens 2; DELETE)",
                                   outcome, time.monotonic() - t0, detail))
            _progress("http", total, total, name, outcome, time.monotonic() - t0, detail)
    finally:
        code = server.stop()
    log = server.log.read_text(errors="replace")
    if code not in (0, 130, -signal.SIGINT):
        results.append(Outcome("http", "check: the server exits on SIGINT", "kill -INT <tandem serve>",
                               "hang" if code is None else "other", 30.0, f"exit {code}; {tail(log, 600)}",
                               check=True))
    if "Traceback (most recent call last)" in log:  # an exception inside the server, answered or not
        blocks = log.split("Traceback (most recent call last)")[1:]
        errors = Counter(next((line for line in b.splitlines() if line and not line.startswith((" ", ":"))), "?")
                         for b in blocks)
        results.append(Outcome("http", "check: no traceback in the server log", f"tandem {' '.join(server.args)}",
                               "traceback", 0.0, f"{len(blocks)} traceback(s) in the server log: " +
                               "; ".join(f"{e} (x{n})" for e, n in errors.items()), check=True))
    return results, statuses


def _status_class(status: int | str | None) -> str:
    if isinstance(status, int):
        return f"{status // 100}xx"
    return {"timeout": "timeout"}.get(status, "conn")  # type: ignore[arg-type]


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
        proc = subprocess.Popen([sys.executable, "-m", "tandem.cli", *args], cwd=work, env=_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
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
    proc = subprocess.Popen([sys.executable, "-m", "tandem.cli", *args], cwd=work, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
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


# -- report --------------------------------------------------------------------------------------------------------

PASS = {"cli": "clear", "http": "ok", "faults": "survived"}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def table(results: list[Outcome], group: str, extra: str) -> str:
    rows = [r for r in results if r.group == group]
    if not rows:
        return ""
    lines = [f"### {group} ({extra})", "", "| case | command | outcome | s |", "|---|---|---|---|"]
    for r in rows:
        mark = r.outcome if r.outcome == PASS[group] else f"**{r.outcome}**"
        lines.append(f"| {_cell(r.name)} | `{_cell(r.command)}` | {mark} | {r.seconds:.1f} |")
    return "\n".join(lines)


def summarize(results: list[Outcome], statuses: Counter, seconds: float) -> dict:
    cli = [r for r in results if r.group == "cli"]
    http_ = [r for r in results if r.group == "http" and not r.check]
    faults = [r for r in results if r.group == "faults"]
    misses = [r for r in results if r.outcome != PASS[r.group]]
    return {
        "bad_inputs": len(cli),
        "clear_errors": sum(r.outcome == "clear" for r in cli),
        "http_cases": len(http_),
        "http_ok": sum(r.outcome == "ok" for r in http_),
        "http_5xx": sum(r.outcome == "5xx" for r in http_),
        "http_status": dict(sorted(statuses.items())),
        "faults": len(faults),
        "survived": sum(r.outcome == "survived" for r in faults),
        "hangs": sum(r.outcome == "hang" for r in results),
        "data_lost": sum(r.data_lost for r in results),
        "seconds": round(seconds, 1),
        "cases": [{"group": r.group, "name": r.name, "outcome": r.outcome} for r in results],
        "misses": [{"group": r.group, "name": r.name, "outcome": r.outcome, "command": r.command, "output": r.detail}
                   for r in misses],
    }


def summary_table(s: dict) -> str:
    st = s["http_status"]
    status = ", ".join(f"{k}: {v}" for k, v in st.items()) or "-"
    return "\n".join([
        "| measure | figure | aim |",
        "|---|---|---|",
        f"| bad inputs tried / clear errors | {s['bad_inputs']} / {s['clear_errors']} | every one clear |",
        f"| HTTP cases / answered as expected / cases with a 5xx | {s['http_cases']} / {s['http_ok']} / "
        f"{s['http_5xx']} | 0 5xx |",
        f"| HTTP responses by class (bad requests + load) | {status} | no 5xx |",
        f"| faults injected / survived | {s['faults']} / {s['survived']} | every one survived |",
        f"| hangs | {s['hangs']} | 0 |",
        f"| data lost (steps missing after resume, user files changed) | {s['data_lost']} | 0 |",
    ])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", default="cli,http,faults", help="comma-separated: cli, http, faults")
    ap.add_argument("--quick", action="store_true", help="a subset of each group (the test's)")
    ap.add_argument("--json-out", default=None, help="also write the RESULT object to this file")
    ap.add_argument("--cases", default=None, metavar="REGEX", help="only the cases whose name matches (to repeat a miss)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch folder (its path goes to stderr)")
    args = ap.parse_args(argv)
    groups = [g.strip() for g in args.groups.split(",") if g.strip()]
    unknown = sorted(set(groups) - set(PASS))
    if unknown or not groups:
        ap.error(f"--groups: unknown group {unknown[0] if unknown else '(none)'} (choose from cli, http, faults)")
    only = re.compile(args.cases, re.I) if args.cases else None
    start = time.monotonic()
    scratch = Path(tempfile.mkdtemp(prefix="tandem-reliability-"))
    ctx = Context(scratch)
    results: list[Outcome] = []
    statuses: Counter = Counter()
    try:
        if "cli" in groups:
            results += run_cli(ctx, args.quick, only)
        if "http" in groups:
            http_results, statuses = run_http(ctx, args.quick, only)
            results += http_results
        if "faults" in groups:
            results += run_faults(ctx, args.quick, only)
    finally:
        if args.keep:
            print(f"[scratch] {scratch}", file=sys.stderr)
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    s = summarize(results, statuses, time.monotonic() - start)
    notes = {"cli": "outcome clear: the documented exit code, one `tandem: error:` line naming the value, no "
                    "traceback",
             "http": "outcome ok: the expected status, then a good request served on the same connection",
             "faults": "outcome survived: see the case"}
    for g in groups:
        print(table(results, g, notes[g]))
        print()
    if any(r.group == "faults" for r in results):
        print("what survived means, per fault:\n")
        for c in fault_cases():
            if any(r.name == c.name for r in results):
                print(f"- {c.name}: {c.survived_means}")
        print()
    print("### summary (issue 23)\n")
    print(summary_table(s))
    print()
    if s["misses"]:
        print("### misses\n")
        for m in s["misses"]:
            print(f"- [{m['group']}] {m['name']}: **{m['outcome']}**\n  - command: `{m['command']}`\n"
                  f"  - output: {m['output']}")
        print()
    print(f"{len(results)} cases in {s['seconds']:.0f}s")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(s, indent=1))
    print("RESULT " + json.dumps(s), flush=True)
    return 0 if not s["misses"] else 1


if __name__ == "__main__":
    sys.exit(main())
