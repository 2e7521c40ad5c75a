"""runtime.malloc_mmap_threshold: freed tensors go back to the system instead of staying resident in glibc's
arenas (tandem/runtime/allocator.py). Each case runs in a fresh interpreter: the setting is per process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tandem.config import ConfigError, load_config
from tandem.runtime.allocator import set_mmap_threshold

# A training step in miniature: a large buffer is freed (glibc then raises its mmap threshold to that size),
# then many activation-sized tensors are allocated and freed, except the newest, which pins the heap top.
_CHILD = r"""
import json, sys
import torch
from tandem.runtime.allocator import set_mmap_threshold
def rss_mib():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon"):
            return int(line.split()[1]) / 1024
applied = set_mmap_threshold(int(sys.argv[1]))
base = rss_mib()
big = torch.ones(4 << 20)  # 16 MiB: mmap'd, and its free raises the threshold to 16 MiB
del big
acts = [torch.ones(1 << 20) for _ in range(150)]  # 150 x 4 MiB
pinned = acts[-1]
del acts
print(json.dumps({"applied": applied, "retained_mib": rss_mib() - base}))
"""


def _retained(threshold: int) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, str(threshold)], capture_output=True, text=True, check=True,
                         env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc only")
def test_a_fixed_threshold_returns_freed_tensors_to_the_system():
    default = _retained(0)  # glibc's dynamic threshold: the 4 MiB tensors went to the heap and stay there
    fixed = _retained(1 << 20)
    assert not default["applied"] and fixed["applied"]
    assert default["retained_mib"] > 400, default
    assert fixed["retained_mib"] < 50, fixed


def test_bad_values_are_refused_with_the_limit(tmp_path):
    with pytest.raises(ValueError, match=r"malloc_mmap_threshold=-1 must be in \[0, 33554432\] bytes"):
        set_mmap_threshold(-1)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {name: tiny-qwen3}\n")
    from tandem.runtime.config import RunConfig

    with pytest.raises(ConfigError, match=r"malloc_mmap_threshold=67108864 must be in \[0, 33554432\]"):
        load_config(RunConfig, recipe, ["runtime.malloc_mmap_threshold=67108864"])


# -- runtime.allocator: tcmalloc / jemalloc preloaded by `tandem train` ----------------------------------

from tandem.runtime.allocator import AllocatorError, find_allocator, resolve_allocator  # noqa: E402

TCMALLOC = find_allocator("tcmalloc")


def test_auto_falls_back_to_glibc_and_a_named_allocator_that_is_missing_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_ALLOCATOR_DIRS", str(tmp_path))  # nothing installed there
    assert resolve_allocator("auto") == ("glibc", None)
    assert resolve_allocator("glibc") == ("glibc", None)
    with pytest.raises(AllocatorError, match=rf"runtime.allocator=jemalloc: none of libjemalloc.so.2 in {tmp_path}"):
        resolve_allocator("jemalloc")


def test_an_unknown_allocator_is_refused_by_the_config(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {name: tiny-qwen3}\n")
    from tandem.runtime.config import RunConfig

    with pytest.raises(ConfigError, match="allocator"):
        load_config(RunConfig, recipe, ["runtime.allocator=mimalloc"])


@pytest.mark.skipif(TCMALLOC is None, reason="tcmalloc not fetched (make allocator: needs apt-get)")
def test_tandem_train_restarts_itself_under_tcmalloc_once_and_runs(tmp_path):
    """`tandem train` with the default `auto` runs under tcmalloc (same PID, one restart); `glibc` stays."""
    import os

    recipe = "recipes/tiny/grpo-sync.yaml"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("LD_PRELOAD", None)
    for choice, expected in (("auto", "tcmalloc"), ("glibc", "glibc")):
        out = subprocess.run(
            [sys.executable, "-m", "tandem", "train", recipe, "run.steps=1", "eval.sets=[]", f"runtime.allocator={choice}",
             "--run-dir", str(tmp_path / choice), "--quiet"],
            capture_output=True, text=True, env=env, timeout=600,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        assert f"host allocator: {expected}" in out.stderr, out.stderr[-2000:]
        assert out.stderr.count("restarting under") == (1 if expected != "glibc" else 0)


@pytest.mark.skipif(TCMALLOC is None, reason="tcmalloc not fetched (make allocator: needs apt-get)")
def test_a_program_calling_cli_main_is_never_restarted(tmp_path):
    """main(["train", ...]) from another program (this test) runs in place: only the command's own
    process may be restarted under another allocator."""
    from tandem.cli import main
    from tandem.runtime.allocator import active_allocator

    before = active_allocator()
    assert main(["train", "recipes/tiny/grpo-sync.yaml", "run.steps=1", "eval.sets=[]",
                 "--run-dir", str(tmp_path / "run"), "--quiet"]) == 0
    assert active_allocator() == before


_RATE_CHILD = r"""
import json, os
from tandem.runtime.allocator import reexec_under
name = reexec_under("tcmalloc")
print(json.dumps({"allocator": name, "rate": os.environ.get("TCMALLOC_RELEASE_RATE")}))
"""


@pytest.mark.skipif(TCMALLOC is None, reason="tcmalloc not fetched (make allocator: needs apt-get)")
def test_the_restart_under_tcmalloc_keeps_freed_memory_unless_the_environment_says_otherwise():
    """The restart sets TCMALLOC_RELEASE_RATE=0 (freed pages stay for the next step), never over a user's own value."""
    import os

    base = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": os.getcwd()}
    for extra, rate in (({}, "0"), ({"TCMALLOC_RELEASE_RATE": "2.5"}, "2.5")):
        out = subprocess.run([sys.executable, "-c", _RATE_CHILD], capture_output=True, text=True, check=True,
                             env={**base, **extra}, timeout=120)
        assert json.loads(out.stdout.strip().splitlines()[-1]) == {"allocator": "tcmalloc", "rate": rate}, out.stderr


def test_the_restart_reads_the_allocator_without_importing_torch(tmp_path):
    """`tandem train` restarts before it builds the config (which imports torch, ~2 s the restarted process
    would spend again): the early read gives the recipe's and the overrides' choice, the default without a
    `runtime` section, and None (left to the full build to report) for what it cannot read."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {name: tiny-qwen3}\nruntime: {allocator: glibc}\n")
    bare = tmp_path / "bare.yaml"
    bare.write_text("model: {name: tiny-qwen3}\n")
    probe = (
        "import json, sys\n"
        "from tandem.commands.train import _allocator_choice\n"
        f"r, b = {str(recipe)!r}, {str(bare)!r}\n"
        "out = [_allocator_choice(r, []), _allocator_choice(r, ['runtime.allocator=tcmalloc']),\n"
        "       _allocator_choice(b, []), _allocator_choice(b, ['runtime=3']), _allocator_choice(r + 'x', []),\n"
        "       _allocator_choice(b, ['runtime.allocator=[1]'])]\n"
        "print(json.dumps({'choices': out, 'torch': 'torch' in sys.modules}))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"choices": ["glibc", "tcmalloc", "auto", None, None, None], "torch": False}
    from tandem.runtime.allocator import DEFAULT_CHOICE
    from tandem.runtime.config import RuntimeConfig

    assert RuntimeConfig().allocator == DEFAULT_CHOICE == "auto"


@pytest.mark.skipif(TCMALLOC is None, reason="tcmalloc not fetched (make allocator: needs apt-get)")
def test_a_bad_recipe_is_still_one_error_line_after_the_early_restart(tmp_path):
    import os

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("LD_PRELOAD", None)
    out = subprocess.run(
        [sys.executable, "-m", "tandem", "train", "recipes/tiny/grpo-sync.yaml", "run.stepz=1",
         "--run-dir", str(tmp_path / "run"), "--quiet"],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("tandem: error:")]
    assert len(errors) == 1 and "run.stepz" in errors[0], out.stderr[-2000:]
    assert "Traceback" not in out.stderr and not (tmp_path / "run").exists()


# Freed memory the allocator keeps resident, then `release_free_memory`: 256 MiB of tensors freed stay with
# tcmalloc (freed spans) and with glibc when its mmap threshold is above their size (set below, as a grown
# dynamic threshold would be); the release hands them back, and live tensors keep their contents.
_RELEASE_CHILD = r"""
import json, sys
import torch
from tandem.runtime.allocator import active_allocator, release_free_memory, set_mmap_threshold
def rss_mib():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon"):
            return int(line.split()[1]) / 1024
if active_allocator() == "glibc":
    set_mmap_threshold(32 << 20)  # 8 MiB pieces below it: served from the heap, kept there when freed
live = torch.arange(1 << 20, dtype=torch.float32)
base = rss_mib()
pieces = [torch.ones(2 << 20) for _ in range(33)]  # 33 x 8 MiB, touched
pinned = pieces[-1]  # the newest stays live: glibc cannot simply lower its heap's top
del pieces
kept = rss_mib() - base - 8
released = release_free_memory()
print(json.dumps({"allocator": active_allocator(), "kept_mib": kept, "after_mib": rss_mib() - base,
                  "released": released, "live_ok": bool(torch.equal(live, torch.arange(1 << 20, dtype=torch.float32)))}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc / tcmalloc on Linux")
@pytest.mark.parametrize("allocator", ["glibc", "tcmalloc"])
def test_release_free_memory_hands_freed_memory_back(allocator):
    import os

    if allocator == "tcmalloc" and TCMALLOC is None:
        pytest.skip("tcmalloc not fetched (make allocator: needs apt-get)")
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": os.getcwd()}
    if allocator == "tcmalloc":
        env["LD_PRELOAD"] = str(TCMALLOC)
    out = subprocess.run([sys.executable, "-c", _RELEASE_CHILD], capture_output=True, text=True, check=True, env=env)
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["allocator"] == allocator and found["released"] and found["live_ok"], found
    assert found["kept_mib"] > 200, found  # the freed 256 MiB stayed resident
    assert found["after_mib"] < 48, found  # and went back to the system on release (8 MiB stay live)
