"""An HF folder's ``config.json`` for the native model, read without importing transformers where it can.

``AutoConfig.from_pretrained`` of a Llama config imports a large part of transformers (its config module
pulls in the type validators, activations and the kernel hub): ~1.4 s and ~80 MiB of resident memory in a
process that otherwise needs none of it, such as an FSDP rank or an inference actor building the native
model. For the architectures the native model implements, with the default rotary embedding, the fields
`TransformerArgs` reads are taken from the file with the defaults of transformers' own config classes
(tests/models/test_hf_config.py checks the result against ``AutoConfig`` field by field, and with fields
left out). Anything else (another architecture, scaled or partial rotary embeddings) goes through
``AutoConfig`` as before.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

__all__ = ["ConfigJSON", "read_hf_config"]

# transformers' config-class defaults (LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig) for the fields
# the native model reads; a field the file sets (to null included) takes the file's value, as HF does.
_COMMON = dict(hidden_act="silu", rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=10000.0)
_QWEN = dict(_COMMON, vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
             num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=32768,
             use_sliding_window=False)
DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(_COMMON, vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=None, max_position_embeddings=2048,
                  attention_bias=False, mlp_bias=False, head_dim=None),
    "qwen2": _QWEN,
    "qwen3": dict(_QWEN, head_dim=128, attention_bias=False),
    "qwen3_moe": dict(_QWEN, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_key_value_heads=4,
                      attention_bias=False, decoder_sparse_step=1, moe_intermediate_size=768,
                      num_experts_per_tok=8, num_experts=128, norm_topk_prob=False, mlp_only_layers=None),
}
# names a config class stores a field under (its ``attribute_map``): the file may hold either
ALIASES: dict[str, dict[str, str]] = {"qwen3_moe": {"num_experts": "num_local_experts"}}


class ConfigJSON:
    """The attributes of an HF config that the native model reads, from the file plus HF's defaults.

    ``rope_parameters`` is normalised as transformers does (``rope_type`` and ``rope_theta`` in one dict);
    ``to_dict()`` returns the file's own content (what ``save_pretrained`` writes back)."""

    def __init__(self, raw: dict[str, Any]) -> None:
        self._raw = raw
        mt = raw["model_type"]
        merged = {**DEFAULTS[mt], **raw}
        for name, stored in ALIASES.get(mt, {}).items():
            if stored in raw:
                merged[name] = raw[stored]
        rope = _rope(raw)
        rope.setdefault("rope_theta", merged["rope_theta"])
        merged["rope_parameters"] = rope
        # a key named like this class's own attributes (to_dict, _raw) cannot shadow them
        self.__dict__.update({k: v for k, v in merged.items() if not hasattr(ConfigJSON, k) and k != "_raw"})

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self._raw)

    def __repr__(self) -> str:
        return f"ConfigJSON(model_type={self._raw['model_type']!r})"


def _rope(raw: dict[str, Any]) -> dict[str, Any]:
    """The file's rope settings (``rope_parameters``, or the older ``rope_scaling``) with ``rope_type`` set."""
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    rope.setdefault("rope_type", rope.get("type", "default"))
    return rope


def _plain(raw: dict[str, Any]) -> bool:
    """True where the file alone describes the model: a native architecture with the default rotary embedding."""
    if raw.get("model_type") not in DEFAULTS or raw.get("partial_rotary_factor") not in (None, 1, 1.0):
        return False
    settings = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(settings, dict) or any(isinstance(v, dict) for v in settings.values()):  # per-layer-type
        return False
    return _rope(raw)["rope_type"] == "default"


def read_hf_config(path: str | Path) -> Any:
    """The config of the HF folder ``path``: a `ConfigJSON` where the file alone describes a model the native
    implementation supports, else transformers' ``AutoConfig``. FileNotFoundError for a folder without one."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{file} does not exist: not an HF model folder")
    try:
        raw = json.loads(file.read_text())
    except ValueError:  # not JSON: transformers' error says what it expected
        raw = None
    if isinstance(raw, dict) and _plain(raw):
        return ConfigJSON(raw)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path))
