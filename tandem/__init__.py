"""Tandem: PyTorch-native RL post-training for LLMs.

Importing ``tandem`` is cheap and imports no engine (vllm, sglang, megatron, ray, cupy): adapters
import their engine when they are built.
"""

__version__ = "0.1.0"
