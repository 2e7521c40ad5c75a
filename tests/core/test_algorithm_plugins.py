"""User estimators and policy losses selected by import path through the config system.

The plug-ins live in tests/core/algorithm_plugins.py, outside `tandem`; each number here is computed
by hand from its formula.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from tandem.config import ConfigError, from_dict, load_config, to_dict
from tandem.core.advantages import ADVANTAGE_ESTIMATORS, AdvantageConfig, compute_advantages
from tandem.core.algorithm import AlgorithmConfig
from tandem.core.losses import POLICY_LOSSES, loss_scale_from_masks
from tandem.core.protocols import LogProbOutput
from tandem.core.registry import PluginError, SpecRegistry
from tests.core import algorithm_plugins as plugins
from tests.core.batches import make_batch

MOD = "tests.core.algorithm_plugins"
F64 = torch.float64


def _algo(advantage=None, policy_loss=None, **sections) -> AlgorithmConfig:
    data = {"advantage": advantage or {}, "policy_loss": policy_loss or {}} | sections
    return from_dict(AlgorithmConfig, data)


# -- estimators -----------------------------------------------------------------------------------


def test_user_estimator_with_options_by_hand():
    cfg = _algo({"estimator": f"{MOD}:CLIPPED_BASELINE", "options": {"scale": 3, "clip": 1.5}})
    opts = cfg.advantage.options
    assert isinstance(opts, plugins.ClippedBaselineConfig) and opts.scale == 3.0 and opts.clip == 1.5
    assert type(opts.scale) is float  # an int in the recipe widens to the float field
    assert cfg.advantage.uses_groups and not cfg.advantage.whitens and not cfg.needs_critic
    mask = [[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
    batch = make_batch(mask, rewards=[1.0, 0.0, 0.0, 4.0], group_index=[0, 0, 0, 1])
    out, metrics = compute_advantages(batch, cfg.advantage)
    # group 0: mean 1/3, scaled by 3 -> (2, -1, -1), clipped at 1.5; group 1 is a lone sample -> 0
    expected = [[1.5, 1.5], [-1.0, 0.0], [-1.0, -1.0], [0.0, 0.0]]
    assert torch.allclose(out.advantages, torch.tensor(expected))
    assert out.returns is None
    assert metrics["adv/num_groups"] == 2.0  # uses_groups: the group metrics are logged


def test_user_estimator_needing_a_critic_by_hand():
    cfg = _algo({"estimator": f"{MOD}:VALUE_BASELINE", "gamma": 0.5})
    assert cfg.needs_critic and not cfg.advantage.uses_groups and cfg.advantage.options is None
    mask = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
    values = [[0.5, 0.2, 0.1], [0.3, -0.1, 7.0]]
    batch = make_batch(mask, rewards=[1.0, 0.0], group_index=[0, 1], values=values)
    out, _ = compute_advantages(batch, cfg.advantage)
    # reward 1 on the last token of row 0, discounted by 0.5 per step back: G = (0.25, 0.5, 1)
    returns = [[0.25, 0.5, 1.0], [0.0, 0.0, 0.0]]
    advantages = [[0.25 - 0.5, 0.5 - 0.2, 1.0 - 0.1], [-0.3, 0.1, 0.0]]
    assert torch.allclose(out.returns, torch.tensor(returns))
    assert torch.allclose(out.advantages, torch.tensor(advantages))


def test_recipe_overrides_select_a_user_estimator():
    cfg = load_config(
        AlgorithmConfig,
        overrides=[f"advantage.estimator={MOD}:CLIPPED_BASELINE", "advantage.options.clip=0.5"],
    )
    assert cfg.advantage.options == plugins.ClippedBaselineConfig(clip=0.5)


def test_plug_in_configs_round_trip_through_the_config_system():
    cfg = _algo(
        {"estimator": f"{MOD}:CLIPPED_BASELINE", "options": {"scale": 2.0}},
        {"loss": f"{MOD}:SQUARED_PENALTY", "options": {"beta": 0.3}},
    )
    data = to_dict(cfg)
    assert data["advantage"]["options"] == {"scale": 2.0, "clip": None}
    assert data["policy_loss"]["options"] == {"beta": 0.3, "flag_above": 0.5}
    assert from_dict(AlgorithmConfig, data) == cfg
    assert replace(cfg.advantage, gamma=0.9).options == cfg.advantage.options  # an instance is kept


def test_declared_flags_drive_the_cross_section_checks():
    with pytest.raises(ConfigError, match="drop_zero_std_groups is for group estimators"):
        _algo({"estimator": f"{MOD}:VALUE_BASELINE"}, filters={"drop_zero_std_groups": True})
    assert _algo({"estimator": f"{MOD}:CLIPPED_BASELINE"}, filters={"drop_zero_std_groups": True})
    assert AdvantageConfig(estimator=f"{MOD}:VALUE_BASELINE", whiten=True).whitens


def test_an_estimator_output_of_the_wrong_shape_is_named():
    batch = make_batch([[1.0, 1.0]] * 2, rewards=[1.0, 0.0], group_index=[0, 0])
    with pytest.raises(ValueError, match=r"estimator '.*:WRONG_SHAPE' returned advantages \(2, 1\)"):
        compute_advantages(batch, AdvantageConfig(estimator=f"{MOD}:WRONG_SHAPE"))


# -- policy loss ----------------------------------------------------------------------------------


def test_user_policy_loss_with_options_by_hand():
    cfg = _algo(policy_loss={"loss": f"{MOD}:SQUARED_PENALTY", "options": {"beta": 0.5, "flag_above": 0.25}})
    mask = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
    adv = [[1.0, 1.0, 1.0], [-2.0, -2.0, 0.0]]
    batch = make_batch(mask, dtype=F64, advantages=adv, old_log_probs=torch.zeros(2, 3))
    lp = torch.tensor([[0.1, -0.2, 0.0], [0.3, 0.0, 9.0]], dtype=F64, requires_grad=True)
    loss, metrics = cfg.build_loss_fn()(
        LogProbOutput(log_probs=lp), batch, loss_scale_from_masks([batch.loss_mask])
    )
    loss.backward()
    # l = -A exp(lr) + beta / 2 lr^2 on the 5 trained tokens, token-mean
    tokens = [(1.0, 0.1), (1.0, -0.2), (1.0, 0.0), (-2.0, 0.3), (-2.0, 0.0)]
    expected = sum(-a * math.exp(lr) + 0.25 * lr * lr for a, lr in tokens) / 5
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    grads = [(-a * math.exp(lr) + 0.5 * lr) / 5 for a, lr in tokens]
    assert lp.grad[torch.tensor(mask) > 0].tolist() == pytest.approx(grads, rel=1e-12)
    assert lp.grad[1, 2] == 0.0
    assert metrics["loss/far_frac"] == pytest.approx(1 / 5)  # only |0.3| > 0.25 (the 9.0 is padding)
    assert "loss/clip_frac" not in metrics and metrics["loss/pg"] == pytest.approx(expected)


def test_dual_clip_is_refused_by_a_loss_without_a_clipped_surrogate():
    with pytest.raises(ConfigError, match=r"dual_clip_c applies to a clipped surrogate.*SQUARED_PENALTY"):
        _algo(policy_loss={"loss": f"{MOD}:SQUARED_PENALTY", "dual_clip_c": 3.0})


# -- bad values -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "section, value, message",
    [
        ("advantage", "gpro", r"unknown advantage estimator 'gpro' \(choose one of: distill, dr_grpo, gae"),
        (
            "policy_loss",
            "ppo",
            r"unknown policy loss 'ppo' \(choose one of: cispo, gspo, ppo_clip; or an import",
        ),
        ("advantage", "no_such_module_xyz:SPEC", r"cannot import module 'no_such_module_xyz'"),
        ("advantage", f"{MOD}:MISSING", r"has no attribute 'MISSING'"),
        (
            "advantage",
            f"{MOD}:plain_estimator",
            r"plain_estimator' is of type function; expected AdvantageEstimatorSpec",
        ),
        (
            "policy_loss",
            f"{MOD}:CLIPPED_BASELINE",
            r"is of type AdvantageEstimatorSpec; expected PolicyLossSpec",
        ),
        ("advantage", f"{MOD}:BAD_ARITY", r"BAD_ARITY': fn: must accept 2 positional argument"),
        ("policy_loss", f"{MOD}:BAD_CONFIG", r"BAD_CONFIG': config must be a dataclass type or None"),
        ("advantage", "a:b:c", r"'a:b:c' is not an import path"),
    ],
)
def test_bad_names_and_paths_are_one_config_error_naming_the_value(section, value, message):
    key = "estimator" if section == "advantage" else "loss"
    with pytest.raises(ConfigError, match=rf"^{section}: .*{message}"):
        from_dict(AlgorithmConfig, {section: {key: value}})


@pytest.mark.parametrize(
    "options, message",
    [
        ({"scael": 2.0}, r"unknown key 'options.scael' of advantage estimator '.*' \(valid keys: clip, scale\); "
                         r"did you mean 'scale'\?"),
        ({"scale": "big"}, r"options.scale of advantage estimator '.*': expected a number, got 'big'"),
        ({"clip": True}, r"options.clip of .*: True does not match"),
        ({"scale": -1.0}, r"options of advantage estimator '.*': scale=-1.0 must be > 0"),
        (3, r"options of advantage estimator '.*' must be a mapping, got int 3"),
    ],
)  # fmt: skip
def test_bad_options_name_the_key_and_the_valid_keys(options, message):
    with pytest.raises(ConfigError, match=rf"^advantage: {message}"):
        _algo({"estimator": f"{MOD}:CLIPPED_BASELINE", "options": options})


def test_options_for_an_entry_without_settings_are_refused():
    with pytest.raises(ConfigError, match=r"advantage estimator 'grpo' takes no options, got \{'scale': 2\}"):
        _algo({"estimator": "grpo", "options": {"scale": 2}})
    with pytest.raises(ConfigError, match=r"policy loss 'ppo_clip' takes no options"):
        _algo(policy_loss={"options": {"beta": 1}})


# -- the registry itself --------------------------------------------------------------------------


def test_registry_rejects_duplicates_paths_as_names_and_wrong_specs():
    reg = SpecRegistry("advantage estimator", type(plugins.CLIPPED_BASELINE), required_params=2)
    reg.add("mine", plugins.CLIPPED_BASELINE)
    assert reg.resolve("mine") is plugins.CLIPPED_BASELINE and "mine" in reg and reg.names() == ["mine"]
    assert reg.resolve(f"{MOD}:VALUE_BASELINE") is plugins.VALUE_BASELINE
    with pytest.raises(ValueError, match="registered twice"):
        reg.add("mine", plugins.VALUE_BASELINE)
    with pytest.raises(ValueError, match="contain no ':'"):
        reg.add("a:b", plugins.VALUE_BASELINE)
    with pytest.raises(PluginError, match="must accept 2 positional"):
        reg.add("bad", plugins.BAD_ARITY)
    assert "grpo" in ADVANTAGE_ESTIMATORS and "ppo_clip" in POLICY_LOSSES
