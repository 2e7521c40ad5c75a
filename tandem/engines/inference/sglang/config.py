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

__all__ = ["OWNED_EMBEDDED_ARGS", "OWNED_SERVER_ARGS", "SGLangEngineConfig"]

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

# The same for ``launch: embedded`` (server_args are the embedded engine's `inference.torch` keys).
OWNED_EMBEDDED_ARGS = {
    "model": "SGLangEngineConfig.model",
    "max_model_len": "SGLangEngineConfig.max_model_len",
    "seed": "SGLangEngineConfig.seed",
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
    # around every weight update: /pause_generation with this mode, the update, /continue_generation.
    # `in_place` (default): requests in flight stay in the server, with their cache, and continue on the new
    # weights (partial rollouts; without a pause SGLang holds the update until every request in flight ends);
    # `retract`: they go back to the server's queue and recompute their cache; `abort`: they end (partial);
    # `none`: no pause (SGLang then waits for requests in flight before updating)
    pause_on_update: Literal["in_place", "retract", "abort", "none"] = "in_place"
    request_timeout_s: float = 600.0  # one /generate (a long response takes a while)
    control_timeout_s: float = 300.0  # weight updates, sleep/wake, aborts, server info
    api_key: str | None = None  # sent as "Authorization: Bearer <key>"
    # launching (``urls`` empty): `sglang` runs `launch_python -m sglang.launch_server` with the model and
    # server_args (flags); `embedded` runs `launch_python -m tandem serve --api sglang` on the embedded engine,
    # server_args being `inference.torch` keys (e.g. deterministic, max_num_seqs): the separate placement of
    # this adapter with no SGLang installed, `replicas` servers of it (the adapter spreads requests over them)
    launch: Literal["sglang", "embedded"] = "sglang"
    replicas: int = 1
    launch_python: str | None = None  # an interpreter with sglang (or tandem) installed (None: this one)
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
        if self.pause_on_update not in ("in_place", "retract", "abort", "none"):
            raise ValueError(f"pause_on_update={self.pause_on_update!r} must be 'in_place', 'retract', 'abort' or 'none'")
        if self.launch not in ("sglang", "embedded"):
            raise ValueError(f"launch={self.launch!r} must be 'sglang' or 'embedded'")
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or self.replicas < 1:
            raise ValueError(f"replicas={self.replicas!r} must be an integer >= 1")
        if self.replicas > 1 and (self.launch != "embedded" or self.urls):
            raise ValueError(f"replicas={self.replicas} applies to launch: embedded without urls; for several SGLang "
                             "servers start them (one per GPU set) and list them in urls, or put sglang-router in front")
        if self.group_backend not in ("gloo", "nccl"):
            raise ValueError(f"group_backend={self.group_backend!r} must be 'gloo' or 'nccl'")
        for name in ("request_timeout_s", "control_timeout_s", "startup_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port={self.port} must be in [0, 65535]")
        if not isinstance(self.server_args, dict):
            raise ValueError(f"server_args must be a mapping, got {type(self.server_args).__name__}")
        table = OWNED_SERVER_ARGS if self.launch == "sglang" else OWNED_EMBEDDED_ARGS
        owned = sorted(set(self.server_args) & set(table))
        if owned:
            raise ValueError(f"server_args[{owned[0]!r}] is set by the adapter: use {table[owned[0]]} instead")
        if self.urls and self.server_args:
            raise ValueError(f"server_args {sorted(self.server_args)} apply only when the adapter launches SGLang "
                             f"(urls is set: {self.urls}); give them to the servers you started")
