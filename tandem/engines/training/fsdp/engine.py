"""`FSDPEngine`: the default training engine (FSDP2 on CPU/gloo or GPU/NCCL, or one plain process).

Data parallelism: each rank is handed its own slice of the global batch (see
`tandem.engines.training.common.split_for_data_parallel`); the loss normalisers (`LossScale`) are
summed over ranks before the first micro-batch and FSDP sums (not averages) gradients, so a step over
N ranks equals one process stepping on the concatenated batch.

Every rank must make the same sequence of calls (each forward and backward gathers shards): ranks
agree on the number of micro-batches and a rank with fewer runs stand-in ones that contribute nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Literal

import torch
from torch import nn

from tandem.core.batch import TrainBatch
from tandem.core.losses import reduce_micro_batch_metrics
from tandem.core.masked import metrics_to_floats
from tandem.core.protocols import EngineAsleepError, EngineClosedError, EngineInfo, LogProbOutput, LossFn
from tandem.engines.training.common import (
    MicroBatch,
    bucket_by_bytes,
    check_batch,
    dummy_micro_batch,
    global_loss_scale,
    make_micro_batch,
    plan_micro_batches,
    split_for_data_parallel,
    step_metrics,
    step_skipped,
    tandem_version,
)
from tandem.engines.training.fsdp import checkpoint as ckpt
from tandem.engines.training.fsdp.config import FSDPConfig, OptimizerConfig
from tandem.engines.training.fsdp.lora import adapters_disabled, apply_lora, frozen_base, hf_tensors
from tandem.engines.training.fsdp.modules import (
    CriticModel,
    LoadedLM,
    PolicyModel,
    apply_quantization,
    check_native_needs,
    decoder_layers,
    load_lm,
    output_module_name,
)
from tandem.engines.training.fsdp.parallel import (
    apply_fsdp,
    enable_activation_checkpointing,
    full_tensor,
    hint_bf16,
    init_distributed,
    total_grad_norm,
    visiting,
)
from tandem.engines.training.fsdp.vocab_parallel import can_shard_vocabulary, shard_vocabulary
from tandem.models.attention import MoERouting
from tandem.models.hf_names import checkpoint_named
from tandem.models.lean_ops import backward_kernels
from tandem.models.recompute import recompute_saved
from tandem.models.registry import DTYPES
from tandem.models.vector_math import warm_vector_math
from tandem.ops import native
from tandem.ops.batch_invariant import batch_invariant_mode
from tandem.runtime.allocator import release_free_memory

__all__ = ["FSDPEngine"]

log = logging.getLogger(__name__)

Role = Literal["policy", "ref", "critic"]


@dataclasses.dataclass(slots=True)
class _StepStats:
    """What one rank's forward/backward passes produced, before the optimizer step."""

    metrics: dict[str, float] = dataclasses.field(default_factory=dict)  # reduced over micro-batches
    loss: float = 0.0
    tokens: int = 0
    mismatch: list[tuple[float, int]] = dataclasses.field(default_factory=list)
    grad_norm: torch.Tensor | None = None


class _Trainable:
    """A (sharded) module with its AdamW, LR schedule and gradient clipping."""

    def __init__(
        self, module: nn.Module, cfg: OptimizerConfig, lr_lambda: Callable[[int], float] | None, lora: bool
    ) -> None:
        self.module = module
        self.params = [p for p in module.parameters() if p.requires_grad]
        # fused: one kernel per parameter, no optimizer-sized temporaries (foreach allocates several)
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=cfg.lr,
            betas=tuple(cfg.betas),
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            fused=True,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda or _constant)
        self.grad_clip = cfg.grad_clip
        self.lora = lora

    def checkpointable(self) -> ckpt.Checkpointable:
        return ckpt.Checkpointable(
            module=self.module,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            frozen_params_saved=not self.lora,
        )


def _constant(step: int) -> float:
    return 1.0


class FSDPEngine:
    """Satisfies `tandem.core.protocols.TrainingEngine`. Build one per rank, on every rank.

    ``lr_lambda(step)`` multiplies the policy's base LR at optimizer step ``step`` (e.g. the core
    scheduler's `lr_multiplier`); ``critic_lr_lambda`` does the same for the critic.
    """

    def __init__(
        self,
        config: FSDPConfig,
        *,
        lr_lambda: Callable[[int], float] | None = None,
        critic_lr_lambda: Callable[[int], float] | None = None,
    ) -> None:
        if config.model is None:
            raise ValueError("FSDPConfig.model is not set: name the model to train")
        self.config = config
        self.ctx = init_distributed(config.parallel, config.device)
        try:
            self._setup(config, lr_lambda, critic_lr_lambda)
        except BaseException:
            self.ctx.close()  # a failed build must not keep a process group it created alive
            raise

    def _setup(
        self,
        config: FSDPConfig,
        lr_lambda: Callable[[int], float] | None,
        critic_lr_lambda: Callable[[int], float] | None,
    ) -> None:
        self._step = 0
        self.deferred_bytes = 0  # read module by module as the models were sharded (fsdp/deferred.py)
        self._asleep = False
        self._closed = False
        torch.manual_seed(config.seed)  # LoRA and value-head init: the same values on every rank
        loaded = load_lm(config.model, packing=config.packing, deferred=self._deferred(
            config.qat is None, qlora=config.lora is not None and config.lora.quantize_base is not None))
        self.model_path, self.native = loaded.path, loaded.native
        self.max_context, self.moe_layers = loaded.max_context, loaded.moe_layers
        check_native_needs(config, loaded)
        self._info = self._describe(loaded)
        hint_bf16(self.ctx, config.parallel.param_dtype, config.model.dtype)
        # the lean backward passes' native kernels (CPU, normal mode), or None: torch's
        self._grad_kernels = native.choose("pointwise", config.pointwise_kernels, self.ctx.device, config.deterministic)
        self._recompute = config.recompute_pointwise
        if config.qat is not None:  # before sharding: QATLinear replaces plain nn.Linear modules
            apply_quantization(loaded, config.qat)
        if config.lora is not None:
            apply_lora(loaded.lm, config.lora)
            if config.lora.quantize_base is not None:  # QLoRA: the frozen base held quantized
                from tandem.engines.training.fsdp.qlora import quantize_base

                quantize_base(loaded.lm, config.lora.quantize_base, output_module=output_module_name(loaded),
                              deferred=loaded.deferred)
        self.policy = _Trainable(
            self._shard(PolicyModel(loaded), loaded, trainable=True),
            config.optimizer,
            lr_lambda,
            lora=config.lora is not None,
        )
        self.ref = self._build_ref()
        self.critic = self._build_critic(critic_lr_lambda)
        if self.ctx.sharded:  # what loading and sharding freed, back to the system
            release_free_memory()

    # -- building -------------------------------------------------------------------------------------

    def _deferred(self, allowed: bool, qlora: bool = False) -> bool:
        """Whether a model loads with its matrices read as it is sharded, or a QLoRA base as it is quantized
        (in any world; fsdp/deferred.py)."""
        return self.config.parallel.sharded_load and (qlora or (allowed and self.ctx.sharded))

    def _describe(self, loaded: LoadedLM) -> EngineInfo:
        """The policy forward as `EngineInfo` reports it (constant for the engine's life)."""
        cfg = self.config
        spec = loaded.lm.args if loaded.native else loaded.lm.config  # TransformerArgs or the HF config
        return EngineInfo(
            name="fsdp",
            version=tandem_version(),
            dtype=cfg.parallel.param_dtype or cfg.model.dtype,
            # LoRA dropout makes the training forward random: no exact contract with it
            deterministic=cfg.deterministic and not (cfg.lora is not None and cfg.lora.dropout > 0),
            moe_layers=tuple(loaded.moe_layers),
            max_context=loaded.max_context or 2**62,
            vocab_size=getattr(spec, "vocab_size", None),
            # sleep moves the weights off the GPU; on a CPU device (or fully CPU-offloaded) it frees nothing
            can_sleep=self.ctx.device.type == "cuda" and not cfg.parallel.cpu_offload,
            routed_experts=cfg.routing_replay,
            lora_adapters=cfg.lora is not None,
            temperature=cfg.temperature or 1.0,
        )

    def _shard(self, root: nn.Module, loaded: LoadedLM, *, trainable: bool, offload: bool = False) -> nn.Module:
        layers = decoder_layers(loaded.lm, loaded.native)
        if trainable and self.config.parallel.activation_checkpointing:
            enable_activation_checkpointing(layers)
        later = loaded.deferred  # matrices still on the meta device (fsdp/deferred.py)
        if later is not None:
            later.track(loaded.lm)  # the final modules (LoRA applied, a critic's head dropped)
        if self.ctx.sharded:
            ignored = self._shard_vocabulary(root, loaded, offload) if isinstance(root, PolicyModel) else None
            apply_fsdp(root, layers, self.ctx, self.config.parallel, offload=offload, ignored=ignored,
                       after_shard=later.materialize if later is not None else None)
        else:
            if later is not None:  # one process (a QLoRA base, quantized as read): the rest read now
                later.materialize(loaded.lm)
            if not offload:  # an offloaded single-process model visits the device per forward
                root.to(self.ctx.device)
        if later is not None:
            later.check_done()
            self.deferred_bytes += later.read_bytes
        return root

    def _shard_vocabulary(self, root: PolicyModel, loaded: LoadedLM, offload: bool) -> set[nn.Parameter] | None:
        """Shard the embedding / LM head by vocabulary rows (fsdp/vocab_parallel.py) where that applies."""
        par = self.config.parallel
        if not par.vocab_parallel or self.config.deterministic or not loaded.native or self.ctx.mesh.ndim != 1:
            return None  # deterministic: the gathered projection gives the embedded engine's bits
        if offload or (par.cpu_offload and self.ctx.device.type != "cpu"):
            return None
        why = can_shard_vocabulary(loaded.lm, self.ctx.world_size)
        if why is not None:
            log.info("vocab_parallel: not used (%s)", why)
            return None
        dtype = DTYPES[par.param_dtype] if par.param_dtype else None
        rows = loaded.deferred.read_rows if loaded.deferred is not None else None  # this rank's rows alone
        return shard_vocabulary(root.lm, self.ctx.mesh, self.ctx.device, dtype, rows)

    def _build_ref(self) -> PolicyModel | None:
        rc = self.config.ref
        if rc is None or (self.config.lora is not None and rc.model is None):
            return None  # no reference, or the LoRA policy with adapters off
        loaded = load_lm(rc.model or self.config.model, packing=self.config.packing,
                         deferred=self._deferred(self.config.qat is None))
        if self.config.qat is not None:  # KL against the quantized initial policy, as the rollout sees it
            apply_quantization(loaded, self.config.qat)
        loaded.lm.requires_grad_(False)
        offload = rc.cpu_offload and self.ctx.device.type == "cuda"
        return self._shard(PolicyModel(loaded), loaded, trainable=False, offload=offload).eval()

    def _build_critic(self, lr_lambda: Callable[[int], float] | None) -> _Trainable | None:
        cc = self.config.critic
        if cc is None:
            return None
        loaded = load_lm(cc.model or self.config.model, packing=self.config.packing, deferred=self._deferred(True))
        module = self._shard(CriticModel(loaded), loaded, trainable=True)
        return _Trainable(module, cc.optimizer, lr_lambda, lora=False)

    # -- protocol -------------------------------------------------------------------------------------

    @property
    def info(self) -> EngineInfo:
        return self._info

    @property
    def step(self) -> int:
        """Policy train steps taken (skipped ones included: the LR schedule advances on both)."""
        return self._step

    def local_rows(self, batch: TrainBatch) -> list[int]:
        """The rows of a global ``batch`` this rank works on (every row in one process)."""
        share = self._share(self.policy.module.native)
        return split_for_data_parallel(batch, self.ctx.world_size, share_prompts=share)[self.ctx.rank]

    def forward_logprobs(
        self, batch: TrainBatch, *, with_entropy: bool = False, model: Role = "policy"
    ) -> LogProbOutput:
        """Response-space ``[B, R]`` float32 outputs of ``model`` on ``batch``, no grad, zeros on padding.

        ``policy`` / ``ref``: log-probs (and entropy); ``critic``: ``values`` (``log_probs`` are zeros).
        """
        module, scope = self._module_for(model)
        self._check(batch)
        plan = self._plan(batch, module.native)
        rows_b, width = batch.batch_size, int(batch.loss_mask.shape[1])
        logp = torch.zeros(rows_b, width)
        entropy = torch.zeros(rows_b, width) if with_entropy and model != "critic" else None
        values = torch.zeros(rows_b, width) if model == "critic" else None
        module.eval()
        with torch.no_grad(), scope, self._invariant():
            for k, (sub, mb) in enumerate(self._micro_batches(batch, plan, module.native)):
                lp, ent, _ = self._run(module, mb, with_entropy=entropy is not None)
                if sub is None:
                    continue
                index, r = torch.as_tensor(plan[k]), mb.response_shape[1]
                target = values if values is not None else logp
                target[index, :r] = mb.to_response(lp).float().cpu()
                if entropy is not None:
                    entropy[index, :r] = mb.to_response(ent).cpu()
        return LogProbOutput(log_probs=logp, entropy=entropy, values=values)

    def train_step(
        self, batch: TrainBatch, loss_fn: LossFn, *, model: Literal["policy", "critic"] = "policy"
    ) -> dict[str, float]:
        """One optimizer step of ``model`` over this rank's ``batch``; returns global metrics.

        The loss function sees each micro-batch (a `TrainBatch`) with a `LogProbOutput` holding the
        policy's log-probs (``entropy`` too when ``loss_fn.needs_entropy`` is true) or, for the
        critic, its ``values``. Its metrics are micro-batch shares of global values, summed over
        micro-batches and ranks (``/max`` and ``/min`` keys reduce by max / min; the convention of
        tandem.core.losses); ``train/loss`` is the exact global loss (sum of micro-batch losses).
        A NaN/Inf loss or gradient on any rank skips the step on all of them
        (``train/skipped_step = 1``): weights and optimizer state stay untouched.
        """
        trainable = self._trainable(model)
        started = time.perf_counter()
        stats = self._accumulate_gradients(batch, loss_fn, model=model)
        return self._finish_step(trainable, model, stats, started)

    def _trainable(self, model: str) -> _Trainable:
        self._check_open()
        trainable = {"policy": self.policy, "critic": self.critic}.get(model)
        if trainable is None:
            raise ValueError(f"cannot train model={model!r} (trainable: policy, and critic if configured)")
        return trainable

    def _accumulate_gradients(self, batch: TrainBatch, loss_fn: LossFn, *, model: str = "policy") -> _StepStats:
        """Forward + backward over all micro-batches; leaves the summed gradients in ``.grad``."""
        trainable = self._trainable(model)
        self._check(batch)
        scale = global_loss_scale(batch, self.ctx.all_reduce)
        module = trainable.module
        module.train()
        trainable.optimizer.zero_grad(set_to_none=True)
        with_entropy = bool(getattr(loss_fn, "needs_entropy", False)) and model == "policy"
        stats = _StepStats()
        loss_total = torch.zeros((), dtype=torch.float64)
        plan = self._plan(batch, module.native)
        for sub, mb in self._micro_batches(batch, plan, module.native):
            with self._invariant(), backward_kernels(self._grad_kernels), recompute_saved(self._recompute):
                lp, ent, routing = self._run(module, mb, with_entropy=with_entropy)
            if sub is None:
                loss = lp.sum() * 0.0
            else:
                loss, metrics = loss_fn(self._output(mb, lp, ent, model), sub.to(self.ctx.device), scale)
                if not loss.requires_grad:  # a constant loss still has to join the gradient collectives
                    loss = loss + lp.sum() * 0.0
                stats.metrics = reduce_micro_batch_metrics([stats.metrics, metrics_to_floats(metrics)])
                stats.tokens += mb.num_tokens
                if routing is not None and routing.replay is not None:
                    stats.mismatch.append((routing.mismatch_fraction(), mb.num_tokens))
            with backward_kernels(self._grad_kernels):  # checkpointed layers record their forward again here
                loss.backward()
            loss_total += loss.detach().double().cpu()
        stats.loss = float(loss_total)
        stats.grad_norm = total_grad_norm(trainable.params)
        return stats

    def _finish_step(
        self, trainable: _Trainable, model: str, stats: _StepStats, started: float
    ) -> dict[str, float]:
        """Agree on skipping across ranks, clip, step AdamW and the LR schedule; build the metrics."""
        everyone = self.ctx.all_gather_object((stats.loss, stats.metrics, stats.tokens, stats.mismatch))
        global_loss = sum(g[0] for g in everyone)
        grad_norm = stats.grad_norm
        norm = float(grad_norm)
        skipped = step_skipped(global_loss, norm)
        lr = float(trainable.scheduler.get_last_lr()[0])
        if not skipped:
            if trainable.grad_clip > 0:
                torch.nn.utils.clip_grads_with_norm_(
                    trainable.params, trainable.grad_clip, grad_norm.to(self.ctx.device)
                )
            trainable.optimizer.step()
        trainable.optimizer.zero_grad(set_to_none=True)
        trainable.scheduler.step()
        if model == "policy":
            self._step += 1
        pairs = [m for g in everyone for m in g[3]]
        extra = {}
        if pairs:
            extra["moe/route_mismatch_frac"] = sum(f * n for f, n in pairs) / max(sum(n for _, n in pairs), 1)
        return step_metrics(
            "train" if model == "policy" else "critic",
            loss=global_loss,
            grad_norm=norm,
            lr=lr,
            skipped=skipped,
            tokens=sum(g[2] for g in everyone),
            started=started,
            rank_metrics=(g[1] for g in everyone),
            device=self.ctx.device,
            extra=extra,
        )

    def named_parameters_for_sync(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """HF-named full policy weights in buckets of at most ``bucket_bytes``.

        Collective under FSDP: every rank must drain the iterator, and every rank receives the same
        full tensors (on its device; a colocated inference engine per rank can use them directly; a
        sync that sends from rank 0 ignores the others). With LoRA: merged weights, or the adapter
        tensors alone (peft names) when ``lora.sync == "adapter"``. Names are the model checkpoint's
        (tandem/models/hf_names.py: an HF model's load-time fusions undone). With ``qat``: the full-precision
        master weights; the engine (``quantization``) or the sync (``sync.quantize``) quantizes them
        with the same op as the forward, so it serves the forward's weights.
        """
        self._check_open()
        adapter_only = self.config.lora is not None and self.config.lora.sync == "adapter"
        gather = partial(full_tensor, device=self.ctx.device)
        lm = self.policy.module.lm
        named = hf_tensors(lm, gather=gather, adapter_only=adapter_only)
        if not adapter_only:  # the checkpoint's names: an HF model may have fused weights at load (MoE experts)
            named = checkpoint_named(lm, named)
        yield from bucket_by_bytes(named, bucket_bytes)

    def frozen_weights(self) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, dict[str, torch.Tensor]]]]:
        """A LoRA policy's frozen base as this process holds it, for a colocated engine to hold instead of its
        own copy (`tandem.sync.inprocess.share_frozen_base`): HF-named plain tensors, and a QLoRA base's
        quantized tensors (`tandem.engines.training.fsdp.lora.frozen_base`). Nothing is copied. Empty unless
        LoRA in one process on the CPU (sharded or GPU-resident weights move or are gathered). This engine
        never writes them: no gradient, no optimizer state, and a LoRA checkpoint holds only the adapters."""
        self._check_open()
        if self.config.lora is None or self.ctx.sharded or self.ctx.device.type != "cpu":
            return [], []
        return frozen_base(self.policy.module.lm)

    def save(self, path: str) -> None:
        """DCP checkpoint of the policy (and critic): weights, optimizer, LR schedule, RNG, step."""
        self._check_open()
        meta = {
            "step": self._step,
            "model": dataclasses.asdict(self.config.model),
            "model_path": self.model_path,
            "native": self.native,
            "lora": dataclasses.asdict(self.config.lora) if self.config.lora else None,
        }
        ckpt.save_checkpoint(path, self._checkpointables(), self.ctx, meta)

    def load(self, path: str) -> None:
        self._check_open()
        meta = ckpt.load_checkpoint(path, self._checkpointables(), self.ctx)
        self._step = int(meta["step"])

    def sleep(self) -> None:
        """Move weights and optimizer state to CPU (GPU memory for a colocated inference engine).

        A no-op on a CPU device, where there is nothing to free.
        """
        self._move_all(torch.device("cpu"))
        self._asleep = True

    def wake_up(self) -> None:
        self._move_all(self.ctx.device)
        self._asleep = False

    def close(self) -> None:
        """Release the process group if this engine created it (under torchrun, without a group of the
        caller's; the last engine on it destroys it). A group the caller created stays. Idempotent;
        afterwards every other call raises `EngineClosedError`."""
        self._closed = True
        self.ctx.close()

    # -- internals ------------------------------------------------------------------------------------

    def _checkpointables(self) -> dict[str, ckpt.Checkpointable]:
        roles = {"policy": self.policy.checkpointable()}
        if self.critic is not None:
            roles["critic"] = self.critic.checkpointable()
        return roles

    def _move_all(self, device: torch.device) -> None:
        if self.ctx.device.type == "cpu" or self.config.parallel.cpu_offload:
            return
        for t in (self.policy, self.critic):
            if t is None:
                continue
            t.module.to(device)
            for state in t.optimizer.state.values():
                for k, v in state.items():
                    if isinstance(v, torch.Tensor):  # fused AdamW wants its step counter beside the params
                        state[k] = v.to(device, non_blocking=True)
        if self.ref is not None and not (self.config.ref and self.config.ref.cpu_offload):
            self.ref.to(device)
        if device.type == "cpu":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("the FSDP engine is closed")

    def _module_for(self, model: Role) -> tuple[nn.Module, contextlib.AbstractContextManager]:
        self._check_open()
        if self._asleep:
            raise EngineAsleepError("the engine is asleep; call wake_up() first")
        if model == "policy":
            return self.policy.module, contextlib.nullcontext()
        if model == "ref":
            if self.ref is not None:
                offloaded = self.config.ref.cpu_offload and not self.ctx.sharded
                return self.ref, visiting(self.ref, self.ctx.device) if offloaded else contextlib.nullcontext()
            if self.config.ref is not None and self.config.lora is not None:
                return self.policy.module, adapters_disabled(self.policy.module)
            raise ValueError("forward_logprobs(model='ref') but the engine has no reference (config.ref)")
        if model == "critic":
            if self.critic is None:
                raise ValueError("forward_logprobs(model='critic') but the engine has no critic (config.critic)")
            return self.critic.module, contextlib.nullcontext()
        raise ValueError(f"model={model!r}: choose 'policy', 'ref' or 'critic'")

    def _check(self, batch: TrainBatch) -> None:
        check_batch(
            batch,
            max_context=self.max_context or 2**62,
            micro_batch_tokens=self.config.micro_batch_tokens,
        )
        if self.config.routing_replay and batch.routed_experts is None:
            raise ValueError("routing_replay=True but the batch has no routed_experts")

    def _share(self, native: bool) -> bool:
        return native and self.config.share_prompts and not self.config.routing_replay

    def _plan(self, batch: TrainBatch, native: bool) -> list[list[int]]:
        """Packed (native) micro-batches budget their tokens; padded ones (HF models) rows x the longest row."""
        return plan_micro_batches(batch, self.config.micro_batch_tokens, share_prompts=self._share(native),
                                  padded=not native)

    def _micro_batches(self, batch: TrainBatch, plan: list[list[int]], native: bool):
        """``(rows' sub-batch, MicroBatch)`` pairs, the micro-batch on the device.

        Padded to the ranks' maximum count with stand-ins ``(None, dummy)`` that keep the collectives of
        every rank in step (also used for a micro-batch with nothing to predict).
        """
        count = int(self.ctx.all_reduce(torch.tensor([len(plan)]), "max")[0])
        for k in range(count):
            if k < len(plan):
                sub = batch.select(plan[k])
                mb = make_micro_batch(
                    sub, packed=native, with_routing=self.config.routing_replay, share_prompts=self._share(native)
                )
                if mb.num_tokens and mb.targets.numel():
                    yield sub, mb.to(self.ctx.device)
                    continue
            yield None, dummy_micro_batch(packed=native, pad_token_id=batch.pad_token_id).to(self.ctx.device)

    def _run(self, module: nn.Module, mb: MicroBatch, *, with_entropy: bool):
        """``(main [M], entropy [M] | None, routing)``: log-probs (policy/ref) or values (critic)."""
        # HF models too: a thread's first MKL cos/exp can be inaccurate (tandem/models/vector_math.py)
        warm_vector_math(self.ctx.device)
        routing = None
        if mb.routed_experts is not None and module.moe_layers:
            routing = MoERouting(module.moe_layers, replay=mb.routed_experts)
        with self._precision():
            if isinstance(module, CriticModel):
                return module(mb, routing=routing), None, routing
            lp, ent = module(
                mb,
                temperature=self.config.temperature,
                with_entropy=with_entropy,
                chunk=self.config.logprob_chunk,
                routing=routing,
            )
        return lp, ent, routing

    def _output(self, mb: MicroBatch, main: torch.Tensor, ent: torch.Tensor | None, model: str) -> LogProbOutput:
        if model == "critic":
            values = mb.to_response(main)
            return LogProbOutput(log_probs=torch.zeros_like(values), values=values)
        return LogProbOutput(
            log_probs=mb.to_response(main), entropy=mb.to_response(ent) if ent is not None else None
        )

    def _precision(self) -> contextlib.AbstractContextManager:
        """One process has no FSDP mixed-precision policy; autocast stands in for ``param_dtype``."""
        dtype = self.config.parallel.param_dtype
        if self.ctx.sharded or dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.ctx.device.type, dtype=DTYPES[dtype])

    def _invariant(self) -> contextlib.AbstractContextManager:
        """Deterministic mode: batch-invariant ops (tandem.ops), the numerics of the embedded engine."""
        return batch_invariant_mode(self.config.deterministic)
