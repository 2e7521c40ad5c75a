"""The planner against peers' published layouts (tests/plan/published.py): each must be judged as fitting,
the planner's own choice must fit on no more GPUs than the source uses, and layouts reported to run out of
memory must be refused."""

from __future__ import annotations

import pytest

from tests.plan.helpers import check_row, plan_row
from tests.plan.published import OOM, PUBLISHED


def _id(row):
    return row["source"].rsplit("/", 1)[-1][:40] + f"-{row['gpus']}"


def test_enough_sources():
    assert len(PUBLISHED) >= 15 and len({r["source"] for r in PUBLISHED}) >= 14
    assert len(OOM) >= 5


@pytest.mark.parametrize("row", PUBLISHED, ids=_id)
def test_published_layout_fits(row):
    result = check_row(row)
    assert result.fits, result.reason
    assert result.memory_gib["trainer"] <= result.memory_gib["capacity"]


@pytest.mark.parametrize("row", PUBLISHED, ids=_id)
def test_own_choice_needs_no_more_gpus(row):
    p = plan_row(row)
    assert p.fits, p.reason
    assert p.min_gpus is not None and p.min_gpus <= row["gpus"]
    assert p.train_gpus <= row["gpus"] and p.rollout_gpus <= row["gpus"]


@pytest.mark.parametrize("row", OOM, ids=_id)
def test_reported_oom_is_refused(row):
    result = check_row(row)
    assert not result.fits
    assert "GiB" in result.reason


def test_oom_layout_fits_with_the_knob_the_planner_names():
    row = OOM[0]  # slime#280: the same layout with the optimizer in host memory is what slime ships
    assert not check_row(row).fits
    assert check_row({**row, "offload": True}).fits
