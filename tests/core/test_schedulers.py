"""LR schedules and KL-coefficient schedules / the adaptive controller."""

from __future__ import annotations

import math

import pytest
import torch

from tandem.core.schedulers import (
    KLController,
    KLScheduleConfig,
    LRScheduleConfig,
    build_lr_scheduler,
    lr_multiplier,
)


def test_constant_with_warmup():
    cfg = LRScheduleConfig(warmup_steps=4)
    assert [lr_multiplier(s, cfg) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert lr_multiplier(0, LRScheduleConfig()) == 1.0


def test_cosine_and_linear_decay_by_hand():
    cos = LRScheduleConfig(kind="cosine", warmup_steps=2, total_steps=12, min_lr_ratio=0.1)
    assert lr_multiplier(1, cos) == 1.0
    assert lr_multiplier(2, cos) == pytest.approx(1.0)
    assert lr_multiplier(7, cos) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the decay
    assert lr_multiplier(12, cos) == pytest.approx(0.1) and lr_multiplier(100, cos) == pytest.approx(0.1)
    lin = LRScheduleConfig(kind="linear", total_steps=10)
    assert [lr_multiplier(s, lin) for s in (0, 5, 10, 11)] == [1.0, 0.5, 0.0, 0.0]


def test_lambda_lr_scheduler_follows_the_multiplier():
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=0.1)
    sched = build_lr_scheduler(opt, LRScheduleConfig(kind="linear", warmup_steps=2, total_steps=6))
    seen = []
    for _ in range(7):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.05, 0.1, 0.1, 0.075, 0.05, 0.025, 0.0])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"min_lr_ratio": 1.5}, "min_lr_ratio"),
        ({"kind": "cosine"}, "needs total_steps"),
        ({"kind": "linear", "total_steps": 3, "warmup_steps": 3}, "total_steps=3 must be > warmup_steps=3"),
    ],
)
def test_lr_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LRScheduleConfig(**kwargs)
    with pytest.raises(ValueError, match="step=-1"):
        lr_multiplier(-1, LRScheduleConfig())


def test_kl_fixed_linear_and_cosine_schedules():
    fixed = KLController(0.1, KLScheduleConfig())
    assert [fixed.update() for _ in range(3)] == [0.1, 0.1, 0.1]
    linear = KLController(0.1, KLScheduleConfig(kind="linear", final_coef=0.0, steps=4))
    assert [linear.update() for _ in range(5)] == pytest.approx([0.075, 0.05, 0.025, 0.0, 0.0])
    cosine = KLController(0.0, KLScheduleConfig(kind="cosine", final_coef=1.0, steps=2))
    assert (
        cosine.value == 0.0
        and cosine.update() == pytest.approx(0.5)
        and cosine.update() == pytest.approx(1.0)
    )


def test_adaptive_controller_by_hand():
    ctl = KLController(0.2, KLScheduleConfig(kind="adaptive", target_kl=0.1, horizon=100))
    # kl twice the target: error clipped to +0.2 -> coef *= 1 + 0.2 * 10 / 100
    assert ctl.update(current_kl=0.2, n_steps=10) == pytest.approx(0.2 * 1.02)
    # kl at half the target: error -0.5 clipped to -0.2
    assert ctl.update(current_kl=0.05, n_steps=10) == pytest.approx(0.2 * 1.02 * 0.98)
    state = ctl.state_dict()
    other = KLController(0.2, KLScheduleConfig(kind="adaptive"))
    other.load_state_dict(state)
    assert other.value == ctl.value and other.step == 20
    with pytest.raises(ValueError, match="needs current_kl"):
        ctl.update()
    with pytest.raises(ValueError, match="not finite"):
        ctl.update(current_kl=math.nan)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"final_coef": -1.0}, "final_coef"),
        ({"kind": "linear"}, "needs steps > 0"),
        ({"target_kl": 0.0}, "target_kl"),
        ({"horizon": 0}, "horizon"),
    ],
)
def test_kl_schedule_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KLScheduleConfig(**kwargs)
    with pytest.raises(ValueError, match="must be >= 0"):
        KLController(-0.1, KLScheduleConfig())
