"""Configuration of the SGLang inference adapter.

Only what Tandem itself needs is a field; every other SGLang server setting goes through ``server_args``
untouched (``python -m sglang.launch_server --<key> <value>``), so an SGLang upgrade never needs a change
here. The adapter either launches one server (``urls`` empty) or connects to running ones (``urls``: SGLang
servers, embedded-engine servers from ``tandem serve --api sglang``, or an ``sglang-router`` in front of
several).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from tandem.models.registry import ModelConfig

__all__ = ["OWNED_SERVER_ARGS", "SGLangEngineConfig"]

# Server arguments the adapter sets itself when it launches SGLang (putting them in server_args is an
# error naming the field to use instead).
OWNED_SERVER_ARGS = {
    "model_path": "SGLangEngineConfig.model",
    "dtype": "SGLangEngineConfig.model.dtype",
    "context_length": "SGLangEngineConfig.max_model_len",
    "random_seed": "SGLangEngineConfig.seed",
    "host": "SGLangEngineConfig.host",
    "port": "SGLangEngineConfig.port",
    "api_key": "SGLangEngineConfig.api_key",
    "skip_tokenizer_init": "nothing (the adapter sends token ids and reads token ids)",
    "enable_return_routed_experts": "nothing (set for MoE models, whose routes R3 replays)",
}


@dataclass(kw_only=True, slots=True)
class SGLangEngineConfig:
    """How the SGLang adapter reaches its servers and moves weights into them."""

    model: ModelConfig | None = None  # None: the run's model (the runtime fills it in)
    urls: list[str] = field(default_factory=list)  # running servers (or a router); empty: launch one
    # the servers behind a router named in ``urls``: control calls (weight updates, aborts, sleep/wake, pause,
    # server info) go to each of them, as sglang-router forwards only generation; empty: ``urls`` themselves
    worker_urls: list[str] = field(default_factory=list)
    max_model_len: int = 2048  # prompt + generated tokens per sequence (the servers must allow it)
    seed: int = 0  # seeds requests without their own seed
    sglang_version: str = "0.5.23*"  # fnmatch pattern of the server versions accepted (get_server_info)
    # how update_weights reaches the servers: `disk` writes a safetensors folder they read
    # (/update_weights_from_disk); `distributed` broadcasts from this process, rank 0 of a group with every
    # server (/init_weights_update_group + /update_weights_from_distributed; gloo on CPU, nccl on GPU)
    weight_transport: Literal["disk", "distributed"] = "disk"
    staging_dir: str | None = None  # disk: where updates are written (None: /dev/shm, else the temp dir)
    group_address: str = "127.0.0.1"  # distributed: the address the servers reach this process on
    group_backend: Literal["gloo", "nccl"] = "gloo"
    request_timeout_s: float = 600.0  # one /generate (a long response takes a while)
    control_timeout_s: float = 300.0  # weight updates, sleep/wake, aborts, server info
    api_key: str | None = None  # sent as "Authorization: Bearer <key>"
    # launching: `launch_python -m sglang.launch_server` on host:port with the model and server_args
    launch_python: str | None = None  # an interpreter with sglang installed (None: this one)
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port
    startup_timeout_s: float = 900.0
    server_args: dict[str, Any] = field(default_factory=dict)  # passed to launch_server as they are
    # adapter-only LoRA sync: the trainer's adapters go to the servers as peft folders (/load_lora_adapter)
    # with this scaling alpha (a run with sync.lora_mode: adapter fills it in); None: merged weights only
    lora_alpha: float | None = None
    lora_max_rank: int = 64

    def __post_init__(self) -> None:
        if self.lora_alpha is not None and not self.lora_alpha > 0:
            raise ValueError(f"lora_alpha={self.lora_alpha} must be > 0 (or None: no adapter-only sync)")
        if self.lora_max_rank < 1:
            raise ValueError(f"lora_max_rank={self.lora_max_rank} must be >= 1")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len={self.max_model_len} must be >= 2 (one prompt + one new token)")
        for name in ("urls", "worker_urls"):
            urls = getattr(self, name)
            if not isinstance(urls, list | tuple) or not all(isinstance(u, str) and u.startswith(("http://", "https://"))
                                                             for u in urls):
                raise ValueError(f"{name}={urls!r} must be a list of http(s):// base URLs")
        if self.worker_urls and not self.urls:
            raise ValueError("worker_urls needs urls (the router in front of them)")
        if self.weight_transport not in ("disk", "distributed"):
            raise ValueError(f"weight_transport={self.weight_transport!r} must be 'disk' or 'distributed'")
        if self.group_backend not in ("gloo", "nccl"):
            raise ValueError(f"group_backend={self.group_backend!r} must be 'gloo' or 'nccl'")
        for name in ("request_timeout_s", "control_timeout_s", "startup_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port={self.port} must be in [0, 65535]")
        if not isinstance(self.server_args, dict):
            raise ValueError(f"server_args must be a mapping, got {type(self.server_args).__name__}")
        owned = sorted(set(self.server_args) & set(OWNED_SERVER_ARGS))
        if owned:
            raise ValueError(f"server_args[{owned[0]!r}] is set by the adapter: use {OWNED_SERVER_ARGS[owned[0]]} "
                             "instead")
        if self.urls and self.server_args:
            raise ValueError(f"server_args {sorted(self.server_args)} apply only when the adapter launches SGLang "
                             f"(urls is set: {self.urls}); give them to the servers you started")
