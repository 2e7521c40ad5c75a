"""The RL loop: modes, placement, checkpoints, tracking."""
