"""The engine registry: one entry per adapter, looked up by the runtime, the CLI and the contracts.

An `EngineEntry` says everything the rest of Tandem needs to know about an engine before building it:

* ``name`` and ``kind`` (``inference`` or ``training``), and ``config``: the import path of its own
  config dataclass (the recipe's ``inference.<name>:`` / ``trainer.<name>:`` section);
* ``factory``: the import path that builds it from that config, so a placement can build it in this
  process, in an engine process or in a Ray actor (an `EngineSpec` carries only the path and the config);
* ``fill(facts, config) -> config``: completes the section from the run (`RunFacts`: model, seed, context,
  temperature, ...), so a recipe names its model once;
* ``capabilities``: what the engine can have at best (`EngineInfo` flag names plus ``critic`` / ``ref``
  for trainers); a run that needs one it lacks is refused at start-up with the setting and the reason,
  and checked again against the built engine's ``info``;
* ``why_not``: for a capability it lacks, why (quoted when a run is refused);
* ``refuse(facts, config) -> {setting: reason}``: engine-specific settings it cannot honour;
* ``describe(config) -> TrainerFacts`` (training): what its config implies for the inference side;
* ``hints``: the setting that turns on a capability, quoted in contract errors;
* ``gpus(config)``: the GPUs one instance needs (a Ray bundle's size: e.g. the tensor-parallel size);
* ``takes_base``: its factory takes ``base=`` (a colocated trainer's frozen LoRA base, `FrozenBase`) and holds
  it from the start instead of reading its own copy from the model files;
* ``contracts``: true-on-policy contracts (tandem.core.contracts) for pairs this engine belongs to.

Built-in entries live in each adapter folder (``tandem/engines/<kind>/<name>/entry.py``) and are
imported only when looked up. A third-party engine is named in a recipe by the import path of its entry
(``inference.engine: my_pkg.engine:ENTRY``) and works without editing Tandem. Security: resolving an
import path imports and runs that module, i.e. user code with the permissions of the Tandem process.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from tandem.core.contracts import PairContract, register_contract
from tandem.core.protocols import EngineInfo
from tandem.models.registry import ModelConfig
from tandem.plugins import PluginError

__all__ = [
    "adapter_changes",
    "INFERENCE_CAPABILITIES",
    "INFERENCE_ENGINES",
    "TRAINING_CAPABILITIES",
    "TRAINING_ENGINES",
    "EngineEntry",
    "EngineRegistry",
    "EngineSpec",
    "RunFacts",
    "TrainerFacts",
    "Unsupported",
    "engines",
    "cuda_available",
    "import_object",
    "registry",
    "run_section",
]

Kind = Literal["inference", "training"]

# Capability names an entry may declare: the EngineInfo flags, plus trainer roles that EngineInfo does
# not describe (a critic for PPO, a frozen reference for KL).
INFERENCE_CAPABILITIES = ("can_sleep", "can_score", "routed_experts", "lora_adapters", "exposes_weights",
                          "partial_updates")
TRAINING_CAPABILITIES = ("can_sleep", "routed_experts", "lora_adapters", "critic", "ref")


class Unsupported(ValueError):
    """A run setting that its engine cannot honour (raised at start-up; the config layer reports it)."""


def import_object(path: str, *, what: str) -> Any:
    """The object at ``module.path:attr`` (attr may be dotted); `PluginError` naming ``what`` otherwise."""
    if not isinstance(path, str) or path.count(":") != 1 or not all(path.split(":")):
        raise PluginError(f"{what}: {path!r} is not an import path of the form 'module.path:name'")
    module, attr = path.split(":")
    try:
        obj: Any = importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - any import failure is reported the same way
        raise PluginError(f"{what}: cannot import module '{module}' of {path!r}: {type(e).__name__}: {e}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise PluginError(f"{what}: module '{module}' has no attribute '{attr}' ({path!r})")
        obj = getattr(obj, part)
    return obj


@dataclass(frozen=True, kw_only=True, slots=True)
class RunFacts:
    """What an engine entry may read off a run to fill its config and decide what it refuses.

    The runtime builds it from the run config; the trainer's own facts (`TrainerFacts`) are merged in
    before the inference engine is configured, so both sides agree (e.g. on LoRA and routing replay).
    """

    model: ModelConfig
    seed: int = 0
    max_context: int  # the longest prompt + response the run produces, capped at the model's context
    rollout_batch: int = 0  # sequences one rollout round submits (prompts_per_step x n_samples_per_prompt)
    replicas: int = 1  # inference.replicas: the inference engines the router spreads a round over
    temperature: float = 1.0  # the rollout's sampling temperature (the shared log-prob convention)
    mode: str = "sync"  # runtime.mode
    placement: str = "colocated"  # runtime.placement
    needs_ref: bool = False  # the algorithm has a KL term: the trainer needs a frozen reference
    needs_critic: bool = False  # GAE: the trainer needs a value model
    recompute_log_probs: bool = False  # rollout.recompute_log_probs: the engine must score sequences
    adapter_sync: bool = False  # sync.lora_mode == "adapter"
    delta_sync: bool = False  # sync.delta: updates hold only the tensors that changed
    verify_sync: bool = False  # sync.verify: the engine's weights are compared with the trainer's
    speculative: Any = None  # rollout.speculative (a tandem.core.speculative.SpeculativeConfig) or None
    # from the trainer's config (TrainerFacts), for the inference side:
    routing_replay: bool = False  # the trainer replays the rollout's MoE routes: the engine must return them
    lora_rank: int | None = None  # the trainer trains LoRA adapters of this rank (None: full weights)
    lora_alpha: float | None = None
    lora_base_quantization: Any = None  # QLoRA: the trainer's base is quantized so (a QuantConfig)

    def with_trainer(self, facts: TrainerFacts) -> RunFacts:
        return dataclasses.replace(self, routing_replay=facts.routing_replay, lora_rank=facts.lora_rank,
                                   lora_alpha=facts.lora_alpha, lora_base_quantization=facts.lora_base_quantization)


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainerFacts:
    """What a training engine's filled config implies for the inference side."""

    routing_replay: bool = False
    lora_rank: int | None = None
    lora_alpha: float | None = None
    lora_base_quantization: Any = None


@dataclass(kw_only=True, slots=True)
class EngineSpec:
    """An engine to build, here or in another process: ``factory`` (``module:callable``) called with
    ``config`` and ``kwargs``. It holds no engine state, so it pickles (engine processes, Ray actors)."""

    factory: str
    config: Any
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        module, _, attr = self.factory.partition(":")
        if not module or not attr:
            raise ValueError(f"engine factory {self.factory!r} must be 'module:callable'")

    def build(self) -> Any:
        return import_object(self.factory, what="engine factory")(self.config, **self.kwargs)


def adapter_changes(facts: RunFacts, section: Any) -> dict[str, Any]:
    """With adapter-only LoRA sync: the trainer's alpha and rank for an engine section with ``lora_alpha`` /
    ``lora_max_rank`` fields that names no alpha of its own (else no change)."""
    if facts.adapter_sync and facts.lora_rank is not None and section.lora_alpha is None:
        return {"lora_alpha": facts.lora_alpha, "lora_max_rank": max(section.lora_max_rank, facts.lora_rank)}
    return {}


def run_section(config: Any, config_class: type, facts: RunFacts) -> tuple[Any, dict[str, Any]]:
    """What every entry's ``fill`` starts from: the recipe's section (or the class's defaults) and the
    changes every engine takes from the run: its seed, and its model where the section names none."""
    section = config if config is not None else config_class(model=facts.model)
    changes: dict[str, Any] = {"seed": facts.seed}
    if section.model is None:
        changes["model"] = facts.model
    return section, changes


def cuda_available() -> bool:
    """Whether this process sees a CUDA device (for the entries' ``gpus``; imports torch lazily)."""
    import torch

    return torch.cuda.is_available()


def _no_refusals(facts: RunFacts, config: Any) -> dict[str, str]:
    return {}


@dataclass(frozen=True, kw_only=True)
class EngineEntry:
    """One engine in the registry (see the module docstring)."""

    name: str
    kind: Kind
    config: str  # 'module:ConfigClass'
    factory: str  # 'module:callable', called as factory(config, **kwargs)
    fill: Callable[[RunFacts, Any], Any]
    capabilities: frozenset[str] = frozenset()
    refuse: Callable[[RunFacts, Any], Mapping[str, str]] = _no_refusals
    describe: Callable[[Any], TrainerFacts] | None = None  # training engines
    why_not: Mapping[str, str] = field(default_factory=dict)  # missing capability -> why (quoted in refusals)
    hints: Mapping[str, str] = field(default_factory=dict)  # capability / contract setting -> how to enable it
    contracts: tuple[PairContract, ...] = ()
    install: str | None = None  # what to install when the factory's module does not import
    gpus: Callable[[Any], float] | None = None  # GPUs one instance needs with this config (Ray bundles)
    takes_base: bool = False  # factory(config, base=FrozenBase): built on a colocated trainer's frozen base

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"engine name {self.name!r} must be an identifier (it is a recipe key)")
        if self.kind not in ("inference", "training"):
            raise ValueError(f"engine {self.name!r}: kind={self.kind!r} must be 'inference' or 'training'")
        known = INFERENCE_CAPABILITIES if self.kind == "inference" else TRAINING_CAPABILITIES
        unknown = sorted(set(self.capabilities) - set(known))
        if unknown:
            raise ValueError(f"engine {self.name!r}: unknown capability {unknown[0]!r} (known: {', '.join(known)})")
        for path in (self.config, self.factory):
            if path.count(":") != 1 or not all(path.split(":")):
                raise ValueError(f"engine {self.name!r}: {path!r} is not an import path 'module:name'")

    def config_class(self) -> type:
        cls = import_object(self.config, what=f"{self.kind} engine {self.name!r} config")
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            raise PluginError(f"{self.kind} engine {self.name!r}: config {self.config!r} is not a dataclass")
        return cls

    def configure(self, facts: RunFacts, config: Any) -> Any:
        """This engine's config for the run: the recipe's section (or None) filled from ``facts``, after
        refusing the settings the engine cannot honour (`Unsupported` naming the setting and why)."""
        self.check_capabilities(self.requirements(facts))
        filled = self.fill(facts, config)
        problems = dict(self.refuse(facts, filled))
        if problems:
            setting, why = next(iter(problems.items()))
            raise Unsupported(f"{setting} does not work with {self._key()}: {self.name} ({why})")
        return filled

    def requirements(self, facts: RunFacts) -> dict[str, tuple[str, str]]:
        """Capability -> (the run setting that needs it, what it is for), for this kind of engine."""
        if self.kind == "training":
            need = {"critic": (facts.needs_critic, "algorithm.advantage.estimator: gae", "a value model"),
                    "ref": (facts.needs_ref, "algorithm.kl (a KL term)", "a frozen reference model")}
        else:
            need = {
                "can_score": (facts.recompute_log_probs, "rollout.recompute_log_probs: true",
                              "a prefill pass that scores sequences (score())"),
                "routed_experts": (facts.routing_replay, "routing replay in the trainer (R3)",
                                   "the routed experts of every generated token"),
                "lora_adapters": (facts.adapter_sync and facts.lora_rank is not None, "sync.lora_mode: adapter",
                                  "LoRA adapters loaded on the base weights"),
                "partial_updates": (facts.delta_sync, "sync.delta: true", "updates that hold only some weights"),
                "exposes_weights": (facts.verify_sync, "sync.verify: true", "the engine's live weights by HF name"),
            }
        return {cap: (setting, why) for cap, (on, setting, why) in need.items() if on}

    def check_capabilities(self, required: Mapping[str, tuple[str, str]], info: EngineInfo | None = None) -> None:
        """Refuse a required capability this engine lacks: by its declaration, or by the built engine's
        ``info`` (authoritative: e.g. a sleep mode that exists only on some devices)."""
        for cap, (setting, why) in required.items():
            declared = cap in self.capabilities
            actual = getattr(info, cap, declared) if info is not None else declared
            if not actual:
                alternatives = [e for e in engines(self.kind) if cap in e.capabilities and e.name != self.name]
                hint = f"; engines that have it: {', '.join(e.name for e in alternatives)}" if alternatives else ""
                reason = f" ({self.why_not[cap]})" if cap in self.why_not else ""
                raise Unsupported(f"{setting} needs {why}, which {self._key()}: {self.name} cannot give"
                                  f"{' on this machine' if info is not None and declared else ''}{reason}{hint}")

    def bundle_gpus(self, config: Any, override: float | None = None) -> float:
        """GPUs one instance asks of its Ray bundle: ``override`` (``ray.*_gpus``) if set, else ``gpus``."""
        if override is not None:
            return override
        return float(self.gpus(config)) if self.gpus is not None else 0.0

    def spec(self, config: Any, **kwargs: Any) -> EngineSpec:
        return EngineSpec(factory=self.factory, config=config, kwargs=kwargs)

    def _key(self) -> str:
        return "inference.engine" if self.kind == "inference" else "trainer.engine"


class EngineRegistry:
    """Engines of one kind by name: the built-ins (entry import paths, imported on first use) and entries
    given by import path or registered by code."""

    def __init__(self, kind: Kind, builtins: Mapping[str, str]) -> None:
        self.kind = kind
        self._paths = dict(builtins)
        self._entries: dict[str, EngineEntry] = {}

    def names(self) -> list[str]:
        return sorted(set(self._paths) | set(self._entries))

    def register(self, entry: EngineEntry) -> EngineEntry:
        """Add ``entry`` (a second entry under a taken name is an error; the same one is a no-op)."""
        if not isinstance(entry, EngineEntry):
            raise TypeError(f"expected an EngineEntry, got {type(entry).__name__}")
        if entry.kind != self.kind:
            raise ValueError(f"engine {entry.name!r} is a {entry.kind} engine, not a {self.kind} engine")
        current = self._entries.get(entry.name)
        if current is entry:
            return entry
        if current is not None:
            raise ValueError(f"{self.kind} engine {entry.name!r} is registered twice")
        builtin = self._paths.get(entry.name)
        if builtin is not None and _load_entry(builtin, self.kind) is not entry:
            raise ValueError(f"{self.kind} engine name {entry.name!r} belongs to a built-in engine; pick another")
        self._entries[entry.name] = entry
        for contract in entry.contracts:
            register_contract(contract)
        return entry

    def get(self, name_or_path: str) -> EngineEntry:
        """The entry of a registered name or an import path ``module:ENTRY`` (registered on first use)."""
        if not isinstance(name_or_path, str) or not name_or_path:
            raise PluginError(f"{self.kind} engine: expected a name or 'module:ENTRY', got {name_or_path!r}")
        if name_or_path in self._entries:
            return self._entries[name_or_path]
        if name_or_path in self._paths:
            return self.register(_load_entry(self._paths[name_or_path], self.kind))
        if ":" in name_or_path:
            entry = _load_entry(name_or_path, self.kind)
            known = self._entries.get(entry.name)
            return known if known is entry else self.register(entry)
        raise PluginError(f"unknown {self.kind} engine {name_or_path!r} (choose one of: {', '.join(self.names())}, "
                          "or give the import path of an EngineEntry, 'module:ENTRY')")


def _load_entry(path: str, kind: Kind, *, check: bool = True) -> EngineEntry:
    entry = import_object(path, what=f"{kind} engine")
    if callable(entry) and not isinstance(entry, EngineEntry):
        entry = entry()  # a function returning the entry
    if not isinstance(entry, EngineEntry):
        raise PluginError(f"{kind} engine {path!r} is a {type(entry).__name__}, not an EngineEntry "
                          "(see tandem.engines.registry)")
    if check and entry.kind != kind:
        raise PluginError(f"{path!r} is a {entry.kind} engine; this setting takes a {kind} engine")
    return entry


INFERENCE_ENGINES = EngineRegistry("inference", {
    "torch": "tandem.engines.inference.torch.entry:ENTRY",
    "vllm": "tandem.engines.inference.vllm.entry:ENTRY",
    "sglang": "tandem.engines.inference.sglang.entry:ENTRY",
})
TRAINING_ENGINES = EngineRegistry("training", {
    "fsdp": "tandem.engines.training.fsdp.entry:ENTRY",
    "megatron": "tandem.engines.training.megatron.entry:ENTRY",
})


def registry(kind: Kind) -> EngineRegistry:
    return INFERENCE_ENGINES if kind == "inference" else TRAINING_ENGINES


def engines(kind: Kind) -> list[EngineEntry]:
    """Every engine of ``kind`` that is registered or built in (built-ins are imported)."""
    reg = registry(kind)
    return [reg.get(name) for name in reg.names()]
