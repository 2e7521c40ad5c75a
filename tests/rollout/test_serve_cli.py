"""``tandem serve``: a real process serving a recipe's model on loopback, and its one-line errors."""

from __future__ import annotations

from pathlib import Path

import httpx2 as httpx
import pytest

from tandem.cli import main
from tests.serve_helpers import serving

ROOT = Path(__file__).parents[2]
RECIPE = ROOT / "recipes" / "tiny" / "calculator-agent-grpo.yaml"


def test_serve_a_recipe_over_http():
    with serving([str(RECIPE), "inference.torch.max_num_seqs=4", "--max-sessions", "2"],
                 env={"TANDEM_API_KEY": "k"}) as base:
        auth = {"Authorization": "Bearer k"}
        assert httpx.post(f"{base}/sessions").status_code == 401  # TANDEM_API_KEY is honoured
        sid = httpx.post(f"{base}/sessions", headers=auth).json()["id"]
        r = httpx.post(f"{base}/sessions/{sid}/v1/chat/completions", headers=auth, timeout=60,
                       json={"messages": [{"role": "user", "content": "What is 1 + 1?"}], "max_tokens": 3})
        assert r.status_code == 200 and r.json()["model"] == "tiny-llama"
        health = httpx.get(f"{base}/health").json()
        assert health["sessions"]["turns"] == 1 and health["engine"]["num_slots"] == 4
        httpx.post(f"{base}/sessions", headers=auth)
        assert httpx.post(f"{base}/sessions", headers=auth).status_code == 429  # --max-sessions 2


@pytest.mark.parametrize("argv, message", [
    (["serve", "tiny-llama", "model.dtype=bfloat16"], "need a recipe"),
    (["serve", "tiny-llama", "--port", "70000"], "port=70000"),
    (["serve", str(RECIPE), "rollout.agent.max_turns=0"], "max_turns=0"),
    (["serve", "tiny-llama", "--chat-template", "/nonexistent.jinja"], "is not a file"),
])
def test_serve_errors_are_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("tandem: error:") and message in err
