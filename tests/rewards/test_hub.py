"""The reward hub: built-ins on hand-made cases, composite terms, plugins and the failure policy."""

from __future__ import annotations

import asyncio
import http.server
import json
import threading
import time

import pytest

from tandem.config import ConfigError, from_dict
from tandem.core.sample import Sample, SampleStatus
from tandem.plugins import PluginError
from tandem.rewards import RewardConfig, RewardHub, RewardTermConfig


def _s(response, label=None, n_tokens=5):
    return Sample(tokens=[1] * (n_tokens + 1), response_length=n_tokens, response=response, label=label)


def _score(name, cases, **kwargs):
    hub = RewardHub(RewardConfig(terms=[RewardTermConfig(name=name, kwargs=kwargs)]))
    samples = [_s(r, lab) for r, lab in cases]
    hub.score(samples)
    hub.close()
    return [s.reward for s in samples]


def test_number_reward():
    assert _score(
        "number", [("The answer is 12.", 12), ("12, no wait 13", 12), ("none", 3), ("1,234", 1234)]
    ) == [1.0, 0.0, 0.0, 1.0]
    assert _score("number", [("12, no wait 13", 12)], position="first") == [1.0]


def test_gsm8k_reward():
    label = "She has 3 + 4 = 7 apples.\n#### 7"
    assert _score("gsm8k", [("so 3+4=7\n#### 7", label), ("#### 8", label), ("it is 7", label)]) == [
        1.0,
        0.0,
        1.0,
    ]


def test_math_reward_equivalence():
    assert _score("math", [("The answer is $\\boxed{\\frac{1}{2}}$", "0.5"), ("$\\boxed{3}$", "4")]) == [
        1.0,
        0.0,
    ]


def test_exact_f1_choice_format_length():
    assert _score("exact_match", [("  Paris ", "paris"), ("Lyon", "Paris")]) == [1.0, 0.0]
    f1 = _score("f1", [("the cat sat", "cat sat down"), ("dog", ["cat", "dog"])])
    assert f1[0] == pytest.approx(0.8) and f1[1] == 1.0
    assert _score("multiple_choice", [("I think the answer is (C).", "C"), ("A or B? B", "A")]) == [1.0, 0.0]
    assert _score("format", [("<answer>3</answer>", None), ("3", None)], pattern=r"<answer>\d+</answer>") == [
        1.0,
        0.0,
    ]
    hub = RewardHub(
        RewardConfig(terms=[RewardTermConfig(name="length_penalty", kwargs={"target_tokens": 4})])
    )
    samples = [_s("x", n_tokens=4), _s("x", n_tokens=8)]
    hub.score(samples)
    assert [s.reward for s in samples] == [0.0, -1.0]


def test_composite_reward_is_a_dict_with_score():
    cfg = RewardConfig(
        terms=[
            RewardTermConfig(name="number"),
            RewardTermConfig(name="format", weight=0.5, kwargs={"pattern": r"^\d+$"}),
        ]
    )
    hub = RewardHub(cfg)
    samples = [_s("7", 7), _s("it is 7", 7), _s("it is 8", 7)]
    m = hub.score(samples)
    assert [s.reward["score"] for s in samples] == [1.5, 1.0, 0.0]
    assert samples[0].reward == {"score": 1.5, "number": 1.0, "format": 1.0}
    assert m["reward/number"] == pytest.approx(2 / 3) and m["reward/mean"] == pytest.approx(2.5 / 3)


# -- plugins and failures ---------------------------------------------------------------------------


def length_reward(sample):
    return float(len(sample.response))


async def async_reward(sample):
    await asyncio.sleep(0)
    return 2.0


def batched_reward(samples):
    return [float(i) for i, _ in enumerate(samples)]


def raising_reward(sample):
    if sample.response == "boom":
        raise RuntimeError("kaboom")
    return 1.0


def nan_reward(sample):
    return float("nan") if sample.response == "nan" else 0.5


def slow_reward(sample):
    if sample.response == "hang":
        time.sleep(3)
    return 1.0


def test_import_path_rewards_sync_async_batched():
    for name, batched, expect in [
        ("tests.rewards.test_hub:length_reward", False, [2.0, 3.0]),
        ("tests.rewards.test_hub:async_reward", False, [2.0, 2.0]),
        ("tests.rewards.test_hub:batched_reward", True, [0.0, 1.0]),
    ]:
        hub = RewardHub(RewardConfig(terms=[RewardTermConfig(name=name, batched=batched)]))
        samples = [_s("ab"), _s("abc")]
        hub.score(samples)
        assert [s.reward for s in samples] == expect, name


def test_failures_mark_samples_failed_and_are_counted():
    for name, bad in [
        ("tests.rewards.test_hub:raising_reward", "boom"),
        ("tests.rewards.test_hub:nan_reward", "nan"),
    ]:
        hub = RewardHub(RewardConfig(terms=[RewardTermConfig(name=name)]))
        samples = [_s("ok"), _s(bad), _s("ok")]
        m = hub.score(samples)
        assert m["reward/failed"] == 1.0
        assert samples[1].status == SampleStatus.FAILED and samples[1].reward is None
        assert "reward_error" in samples[1].metadata
        assert samples[0].status == SampleStatus.PENDING and samples[0].reward is not None


def test_hanging_reward_times_out_and_later_rewards_still_run():
    hub = RewardHub(
        RewardConfig(
            terms=[RewardTermConfig(name="tests.rewards.test_hub:slow_reward")], timeout_s=0.3, num_workers=1
        )
    )
    samples = [_s("hang"), _s("ok")]
    t0 = time.perf_counter()
    m = hub.score(samples)
    assert m["reward/timeout"] >= 1 and samples[0].status == SampleStatus.FAILED
    assert "timed out" in samples[0].metadata["reward_error"]
    again = [_s("ok")]
    hub.score(again)  # a fresh pool serves new work while the hung thread sleeps
    assert again[0].reward == 1.0 and time.perf_counter() - t0 < 2.5


def test_bad_reward_config_is_reported_at_startup():
    with pytest.raises(ConfigError, match="unknown reward 'mathh'"):
        from_dict(RewardConfig, {"terms": [{"name": "mathh"}]})
    with pytest.raises(PluginError, match="cannot import module"):
        RewardHub(RewardConfig(terms=[RewardTermConfig(name="no_such_mod:fn")]))
    with pytest.raises(PluginError, match="bad kwargs"):
        RewardHub(RewardConfig(terms=[RewardTermConfig(name="number", kwargs={"bogus": 1, "position": "x"})]))


class _Handler(http.server.BaseHTTPRequestHandler):
    calls = 0

    def do_POST(self):  # noqa: N802 - http.server API
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Handler.calls += 1
        if _Handler.calls == 1:
            self.send_response(503)
            self.end_headers()
            return
        out = json.dumps({"reward": float(body["response"] == body["label"])}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


def test_remote_reward_retries_transient_errors():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/score"
        hub = RewardHub(
            RewardConfig(
                terms=[RewardTermConfig(name="remote", kwargs={"url": url, "backoff_s": 0.01})], num_workers=1
            )
        )
        samples = [_s("yes", "yes"), _s("no", "yes")]
        m = hub.score(samples)
        assert [s.reward for s in samples] == [1.0, 0.0] and m["reward/failed"] == 0
        assert _Handler.calls == 3  # one 503 retried
    finally:
        server.shutdown()
