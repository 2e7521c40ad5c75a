"""The one-command GPU check (scripts/gpu_check.sh) stays runnable although CI has no GPU.

A GPU is lent rarely, for ~15 minutes, on a bare machine: a kit that broke since it was written (a
renamed config key, a moved import, a bench flag gone) would waste the window. Its dry mode runs the
whole orchestration here (every part's dry command: imports, argument checks, run configs validated,
CUDA never touched), and these tests check the JSON it writes, the budget guard and the kill path.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
PARTS = ["env", "gpu_tests", "kernels", "sync", "contract", "engine", "kernel_suite", "megatron", "sglang"]
HAS_MEGATRON = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None
HAS_SGLANG = importlib.util.find_spec("sglang") is not None
ABSENT = {"megatron": not HAS_MEGATRON, "sglang": not HAS_SGLANG}  # parts skipped for a module not installed
NAME_OK = re.compile(r"^[A-Za-z0-9._-]+$")  # what the device tool brings back from $OUT


def _module():
    spec = importlib.util.spec_from_file_location("tandem_gpu_check", ROOT / "scripts" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


def _dry(out: Path, budget: float | None = None) -> dict:
    env = {**os.environ, "PYTHON": sys.executable, "TANDEM_CACHE_DIR": str(out.parent / "cache")}
    env.pop("OUT", None)
    env.pop("TANDEM_GPU_BUDGET_S", None)
    if budget is not None:
        env["TANDEM_GPU_BUDGET_S"] = str(budget)
    proc = subprocess.run(["bash", str(SCRIPT), str(out), "--dry-run"], env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads((out / "gpu_check.json").read_text())


@pytest.fixture(scope="module")
def full_dry(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check") / "out"
    start = time.monotonic()
    doc = _dry(out)
    return doc, out, time.monotonic() - start


def test_dry_run_rehearses_every_part(full_dry):
    doc, _, wall = full_dry
    assert doc["dry"] is True and doc["budget_s"] == 480
    assert list(doc["parts"]) == PARTS
    for name, entry in doc["parts"].items():
        expected = "skipped" if ABSENT.get(name) else "dry"
        assert entry["status"] == expected, (name, entry)
        assert entry["est_s"] > 0 and entry["command"], name
    assert doc["estimated_total_s"] == sum(e["est_s"] for e in doc["parts"].values())
    # the gpu tests: every file that marks tests gpu, collected (imports fine) on this machine
    gpu = doc["parts"]["gpu_tests"]
    assert "tests/kernels/test_gpu.py" in gpu["command"] and "tests/sync/test_gpu.py" in gpu["command"]
    assert gpu["result"]["collected"] >= 4, gpu
    assert doc["parts"]["kernel_suite"]["result"]["collected"] > 20
    # each bench script ran its own --dry-run to the end
    for name in ("kernels", "sync", "engine", "contract"):
        assert doc["parts"][name]["result"]["dry"] is True, name
    assert doc["parts"]["engine"]["result"]["model_shape"]["num_hidden_layers"] == 30
    assert doc["parts"]["contract"]["result"]["exact_contract"] == "exact"
    # the env probe imported the package module by module; the core never fails
    env = doc["parts"]["env"]["result"]
    assert env["imports"]["imported"] > 50
    assert not [m for m in env["imports"]["failed"] if m.startswith(("tandem.core", "tandem.ops", "tandem.kernels"))]
    assert env["pins"]["torch"] and env["versions"]["torch"]
    assert wall < 600


def test_output_layout_fits_what_the_device_tool_returns(full_dry):
    doc, out, _ = full_dry
    files = sorted(p.name for p in out.iterdir())
    assert files == ["gpu_check.json", "gpu_check.log"]  # no temporary file left behind
    for p in out.iterdir():
        assert NAME_OK.match(p.name) and p.is_file() and p.stat().st_size < 16 << 20
    log = (out / "gpu_check.log").read_text()
    for name, entry in doc["parts"].items():
        if entry["status"] == "dry":
            assert f"===== {name}: " in log and f"===== {name}: dry in " in log
    assert doc["summary"].get("dry", 0) >= 7 and "finished" in doc


def test_budget_guard_skips_what_the_budget_cannot_hold(tmp_path):
    doc = _dry(tmp_path / "out", budget=35)  # the env probe (est 25 s) fits; no later part (est >= 40 s) does
    parts = doc["parts"]
    assert parts["env"]["status"] == "dry"
    for name in PARTS[1:]:
        assert parts[name]["status"] == "skipped", (name, parts[name])
        if not ABSENT.get(name):
            assert re.match(r"budget: needs ~\d+ s, \d+ s of 35 s left", parts[name]["reason"]), parts[name]


def test_guard_moves_on_to_cheaper_parts_and_a_failed_part_is_a_finding(tmp_path, capsys):
    gc = _module()
    ok = [sys.executable, "-c", "print('RESULT {\"x\": 1}')"]
    parts = [
        gc.Part("first", "fits", 10, 60, ok, ok),
        gc.Part("big", "too big for what is left", 100, 200, ok, ok),
        gc.Part("small", "still fits", 15, 60, ok, ok),
        gc.Part("broken", "exits 3", 1, 60, [sys.executable, "-c", "raise SystemExit(3)"], ok),
        gc.Part("absent", "needs a module", 1, 60, ok, ok, requires=("no_such_module_xyz",)),
    ]
    with open(tmp_path / "log", "w") as log:
        doc = gc.Check(tmp_path, parts, budget_s=30, dry=False).run(log)
    p = doc["parts"]
    assert p["first"]["status"] == "passed" and p["first"]["result"] == {"x": 1}
    assert p["big"]["status"] == "skipped" and p["big"]["reason"].startswith("budget: needs ~100 s")
    assert p["small"]["status"] == "passed"
    assert p["broken"]["status"] == "failed" and p["broken"]["returncode"] == 3 and "log_tail" in p["broken"]
    assert p["absent"]["status"] == "skipped" and "no_such_module_xyz" in p["absent"]["reason"]
    assert json.loads((tmp_path / "gpu_check.json").read_text())["summary"] == {"passed": 2, "skipped": 2, "failed": 1}


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def test_an_overrunning_part_is_killed_with_its_children(tmp_path):
    gc = _module()
    code = ("import subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
            "print('CHILD', child.pid, flush=True)\n"
            "time.sleep(120)\n")
    part = gc.Part("hangs", "sleeps past its limit", 1, 2, [sys.executable, "-c", code], [])
    start = time.monotonic()
    with open(tmp_path / "log", "w") as log:
        doc = gc.Check(tmp_path, [part], budget_s=100, dry=False).run(log)
    entry = doc["parts"]["hangs"]
    assert entry["status"] == "timeout" and "killed after 2 s" in entry["reason"]
    assert time.monotonic() - start < 30
    child = int(next(line.split()[1] for line in entry["log_tail"] if line.startswith("CHILD")))
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child), "the part's own subprocess survived the kill"


def test_aims_are_read_from_the_figures():
    gc = _module()
    aims = gc.kernel_aims({"bench": {"ops": {"fp8_block_quant": {"triton": {"ratio": 0.75}}}}})
    assert aims["fp8_block_quant_vs_copy"] == {"value": 0.75, "aim": ">= 0.7", "met": True}
    assert aims["fp8_block_dequant_vs_copy"]["met"] is None  # not measured
    assert gc.contract_aims({"exact_vs_default_step_time": 1.4, "bit_exact": True})[
        "exact_vs_default_step_time"]["met"] is False
    assert gc.sync_aims({"cuda_ipc_vs_d2d_copy": 0.9})["cuda_ipc_vs_d2d_copy"]["met"] is True


def test_list_names_every_part(capsys):
    gc = _module()
    assert gc.main(["--list"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert listed == PARTS


def test_a_check_stopped_from_outside_keeps_its_json_and_takes_the_part_along(tmp_path):
    """What a caller's timeout does (SIGTERM): the running part is killed, the JSON says where it stopped."""
    hang = "import time; print('PART', __import__('os').getpid(), flush=True); time.sleep(120)"
    driver = (
        "import signal, sys, importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('gpu_check', {str(ROOT / 'scripts' / 'gpu_check.py')!r})\n"
        "gc = importlib.util.module_from_spec(spec); sys.modules['gpu_check'] = gc; spec.loader.exec_module(gc)\n"
        "signal.signal(signal.SIGTERM, gc._stop)\n"
        f"parts = [gc.Part('hangs', 'sleeps', 1, 100, [sys.executable, '-c', {hang!r}], []),\n"
        "         gc.Part('after', 'never starts', 1, 100, [sys.executable, '-c', 'pass'], [])]\n"
        f"with open({str(tmp_path / 'log')!r}, 'w') as log:\n"
        f"    gc.Check(gc.Path({str(tmp_path)!r}), parts, budget_s=200, dry=False).run(log)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", driver], stdout=subprocess.PIPE, text=True)
    part_pid = None
    for line in proc.stdout:  # wait until the part runs
        if line.startswith("PART"):
            part_pid = int(line.split()[1])
            break
    proc.terminate()
    proc.communicate(timeout=30)
    assert proc.returncode != 0  # stopped: not a normal end
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert doc["parts"]["hangs"]["status"] == "timeout"
    assert doc["parts"]["after"]["status"] == "skipped"
    assert all(e["reason"] == "the check was stopped from outside" for e in doc["parts"].values())
    deadline = time.monotonic() + 10
    while _alive(part_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(part_pid)
