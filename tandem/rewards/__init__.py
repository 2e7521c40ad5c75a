"""Reward hub: built-in rewards (number, gsm8k, math, exact_match, f1, multiple_choice, format,
length_penalty, remote) and user rewards by import path, scored concurrently."""

from tandem.rewards.hub import RewardConfig, RewardHub, RewardTermConfig, builtin_names

__all__ = ["RewardConfig", "RewardHub", "RewardTermConfig", "builtin_names"]
