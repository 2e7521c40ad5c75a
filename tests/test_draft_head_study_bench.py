"""`bench/draft_head_study.py --quick` (tiny-llama, ~5 s): the study runs end to end and its figures hold together.

The tree estimate with one candidate is the head's own depth-1 acceptance (the same rows, the same ``q``), and
recursive rejection sampling can only add acceptance with each further candidate; every acceptance is a
probability. Guards the script against rot (the bench is not otherwise run by the suite).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_the_quick_draft_head_study(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "draft_head_study.py"), "--quick",
                           "--data", str(tmp_path / "rows.pt")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines and lines[-1].startswith("RESULT "), (proc.stdout[-2000:], proc.stderr[-3000:])
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert set(result["heads"]) == {"mlp", "mlp3", "hybrid", "eagle"}
    for row in result["heads"].values():
        assert len(row["acceptance_by_depth"]) == 4 and all(0 < a <= 1 for a in row["acceptance_by_depth"])
        assert 1 < row["tokens_per_pass_est"] <= 5
    tree = result["tree_acceptance_depth1"]
    assert abs(tree[0] - result["heads"]["mlp"]["acceptance_by_depth"][0]) <= 0.002  # float64 vs float32 sums
    assert all(b >= a for a, b in zip(tree, tree[1:], strict=False)) and tree[-1] > tree[0] and tree[-1] <= 1
    assert (tmp_path / "rows-quick.pt").exists()  # the rows are kept for a rerun
