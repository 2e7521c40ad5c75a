"""oneDNN's shape caches are bounded (tandem/__init__.py, tandem/ops/linear.py "Bounded shape caches"): a
process that runs products of ever new row counts stops growing once the caches are full, and a capacity the
user set wins. Each case is a fresh interpreter: the caches read their capacity at their first use."""

import json
import os
import subprocess
import sys

import pytest

from tandem.ops.linear import CAN_PACK

pytestmark = pytest.mark.skipif(not CAN_PACK, reason="oneDNN's packed linear is not available in this torch build")

# 150 row counts fill a bounded cache; the next 300 are all new shapes: growth after the first 150 is what
# an unbounded cache adds (~0.6 MiB each, measured ~87 MiB per 150 under glibc malloc) or ~0 when bounded
_CHILD = r"""
import json, os, torch
from tandem.ops.linear import fast_linear, pack_weight
def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) / 1024
torch.manual_seed(0)
w = torch.randn(1536, 576)
packed = {id(w): pack_weight(w)}
with torch.inference_mode():
    for m in range(2, 152):
        fast_linear(torch.randn(m, 576), w, packed=packed)
    before = rss()
    for m in range(152, 452):
        fast_linear(torch.randn(m, 576), w, packed=packed)
    after = rss()
print(json.dumps({"growth_mib": after - before, "lru": os.environ.get("LRU_CACHE_CAPACITY"),
                  "primitive": os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY")}))
"""


def _run(env_extra: dict[str, str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")}
    # glibc raises its mmap threshold when a large block is freed (a packed weight of a probe: tandem/ops/linear.py
    # checks packed layouts once per shape), and then keeps freed product outputs in the heap: RSS that is not the
    # caches'. A fixed threshold leaves the growth this test measures, the caches' own.
    env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    env.update(env_extra)
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_new_row_counts_stop_growing_the_process_once_the_caches_are_full():
    import tandem

    got = _run({})
    assert got["lru"] == got["primitive"] == str(tandem.ONEDNN_CACHE_CAPACITY)
    assert got["growth_mib"] < 25, got  # 300 new shapes: ~175 MiB with PyTorch's default capacity


def test_a_capacity_in_the_environment_wins_and_an_unbounded_cache_grows():
    got = _run({"LRU_CACHE_CAPACITY": "1024", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024"})
    assert got["lru"] == got["primitive"] == "1024"
    assert got["growth_mib"] > 80, got  # the growth the bound removes: the first test can fail
