"""`AlgorithmConfig`: presets, recipe validation through the config system, end-to-end step math."""

from __future__ import annotations

import pytest
import torch

from tandem.config import ConfigError, from_dict, to_dict
from tandem.core.advantages import compute_advantages
from tandem.core.algorithm import ALGORITHM_PRESETS, AlgorithmConfig, algorithm_preset
from tandem.core.kl import KLConfig
from tandem.core.losses import loss_scale_from_masks
from tandem.core.protocols import LogProbOutput
from tandem.core.schedulers import KLScheduleConfig
from tests.core.batches import make_batch


@pytest.mark.parametrize("name", sorted(ALGORITHM_PRESETS))
def test_every_preset_round_trips_through_the_config_system(name):
    cfg = algorithm_preset(name)
    assert from_dict(AlgorithmConfig, to_dict(cfg)) == cfg


def test_recipe_section_is_validated_with_key_paths():
    cfg = from_dict(
        AlgorithmConfig, {"advantage": {"estimator": "rloo"}, "policy_loss": {"clip_eps_high": 0.28}}
    )
    assert cfg.advantage.estimator == "rloo" and cfg.policy_loss.clip_eps_high == 0.28
    with pytest.raises(ConfigError, match=r"advantage: unknown advantage estimator 'gpro' \(choose one of: "):
        from_dict(AlgorithmConfig, {"advantage": {"estimator": "gpro"}})
    with pytest.raises(ConfigError, match=r"policy_loss.dual_clip_c=0.5 must be > 1"):
        from_dict(AlgorithmConfig, {"policy_loss": {"dual_clip_c": 0.5}})
    with pytest.raises(ConfigError, match=r"unknown key 'kl.cofe'.*did you mean 'coef'"):
        from_dict(AlgorithmConfig, {"kl": {"cofe": 0.1}})


def test_cross_section_checks():
    with pytest.raises(ValueError, match="drop_zero_std_groups"):
        from_dict(
            AlgorithmConfig, {"advantage": {"estimator": "gae"}, "filters": {"drop_zero_std_groups": True}}
        )
    with pytest.raises(ValueError, match="adaptive"):
        AlgorithmConfig(kl=KLConfig(schedule=KLScheduleConfig(kind="adaptive")))
    with pytest.raises(ValueError, match="unknown algorithm preset 'grpo2'"):
        algorithm_preset("grpo2")


def test_needs_flags():
    assert algorithm_preset("grpo").needs_ref and not algorithm_preset("dapo").needs_ref
    assert algorithm_preset("ppo").needs_critic and not algorithm_preset("grpo").needs_critic
    assert algorithm_preset("opd").needs_teacher


@pytest.mark.parametrize("name", sorted(ALGORITHM_PRESETS))
def test_every_preset_runs_one_step_of_math(name):
    cfg = algorithm_preset(name)
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    old = -torch.rand(4, 3, generator=g)
    batch = make_batch(
        mask, rewards=[1.0, 0.0, 1.0, 0.5], group_index=[0, 0, 1, 1], old_log_probs=old,
        ref_log_probs=old - 0.1, rollout_log_probs=old + 0.05, teacher_log_probs=old + 0.2,
        values=torch.zeros(4, 3),
    )  # fmt: skip
    controller = cfg.kl_controller()
    batch, adv_metrics = compute_advantages(batch, cfg.advantage, kl=cfg.kl, kl_coef=controller.value)
    assert torch.isfinite(batch.advantages).all() and adv_metrics
    log_probs = (old + 0.01).requires_grad_()
    loss, metrics = cfg.build_loss_fn(kl_coef=controller.value)(
        LogProbOutput(log_probs=log_probs), batch, loss_scale_from_masks([mask])
    )
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(log_probs.grad).all() and "loss/pg" in metrics
    if cfg.needs_critic:
        values = torch.zeros(4, 3, requires_grad=True)
        value_loss, _ = cfg.build_value_loss_fn()(
            LogProbOutput(log_probs=log_probs.detach(), values=values), batch, loss_scale_from_masks([mask])
        )
        value_loss.backward()
        assert values.grad.abs().sum() > 0
