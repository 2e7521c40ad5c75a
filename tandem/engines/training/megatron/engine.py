"""`MegatronEngine`: a training engine on Megatron-core (tensor, pipeline, expert and data parallelism).

It satisfies `tandem.core.protocols.TrainingEngine` like the FSDP engine, so the loop, the losses and
the weight sync are shared. Megatron builds the model (``GPTModel`` with the local or the
TransformerEngine layer spec) from the HF folder; `convert` maps HF weights onto its fused, sharded
parameters and back.

Data: each *data-parallel* rank is handed its own slice of the global batch (`local_rows`); the ranks
of one model-parallel group (TP and PP peers) must get the same rows (checked). Loss normalisers
(`LossScale`) are summed over data-parallel ranks before the first micro-batch and gradients are
summed, so a step over N ranks equals one process stepping on the concatenated batch.

Every rank must make the same sequence of calls: the micro-batch count is agreed over the world and
a rank with fewer runs stand-in micro-batches that contribute nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import math
import time
from collections.abc import Callable, Iterator
from typing import Literal

import torch
import torch.distributed as dist

from tandem.core.batch import TrainBatch
from tandem.core.losses import reduce_micro_batch_metrics
from tandem.core.masked import metrics_to_floats
from tandem.core.protocols import EngineAsleepError, EngineClosedError, EngineInfo, LogProbOutput, LossFn
from tandem.engines.training.common import (
    bucket_by_bytes,
    check_batch,
    dummy_micro_batch,
    global_loss_scale,
    make_micro_batch,
    plan_micro_batches,
    split_for_data_parallel,
    step_metrics,
    step_skipped,
)
from tandem.engines.training.megatron import checkpoint as ckpt
from tandem.engines.training.megatron.config import MegatronConfig
from tandem.engines.training.megatron.export import hf_tensors
from tandem.engines.training.megatron.grads import global_grad_norm, reduce_gradients
from tandem.engines.training.megatron.logprobs import head_logprobs
from tandem.engines.training.megatron.lora import adapters_disabled, apply_lora, check_lora, merge_into
from tandem.engines.training.megatron.model import BuiltModel, build_model
from tandem.engines.training.megatron.optim import OptimizerSet
from tandem.engines.training.megatron.parallel import init_model_parallel
from tandem.engines.training.megatron.pipeline import (
    HeadInput,
    StageBatch,
    StageLink,
    gpipe,
    stage_forward,
    stage_shape,
    to_stage_batch,
)
from tandem.models.registry import DTYPES, resolve_model
from tandem.models.vector_math import warm_vector_math

__all__ = ["MegatronEngine"]

Role = Literal["policy", "ref", "critic"]
_EMBEDDING = "embedding.word_embeddings.weight"


@dataclasses.dataclass(slots=True)
class _StepStats:
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    loss: float = 0.0
    tokens: int = 0


def _import_megatron() -> None:
    try:
        import megatron.core  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "the Megatron engine needs megatron-core: pip install 'tandem-rl[megatron]' "
            "(megatron-core==0.16.1 on Python 3.11)"
        ) from e


def _megatron_version() -> str:
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:  # a source checkout on the path
        import megatron.core

        return str(getattr(megatron.core, "__version__", ""))


class MegatronEngine:
    """Satisfies `tandem.core.protocols.TrainingEngine`. Build one per rank, on every rank.

    ``lr_lambda(step)`` multiplies the base LR at optimizer step ``step``. Call `close` when done: it
    releases Megatron's process-global parallel state (and a process group the engine created).
    """

    def __init__(self, config: MegatronConfig, *, lr_lambda: Callable[[int], float] | None = None) -> None:
        if config.model is None:
            raise ValueError("MegatronConfig.model is not set: name the model to train")
        _import_megatron()
        self.config = config
        par = config.parallel
        self.ctx = init_model_parallel(
            tp=par.tensor_parallel,
            pp=par.pipeline_parallel,
            ep=par.expert_parallel,
            etp=par.expert_tensor_parallel,
            backend=par.backend,
            device=config.device,
        )
        try:
            self._setup(config, lr_lambda)
        except BaseException:
            self.ctx.close()  # a failed build must not keep Megatron's global state (or the group) alive
            raise

    def _setup(self, config: MegatronConfig, lr_lambda: Callable[[int], float] | None) -> None:
        par = config.parallel
        self._step = 0
        self._asleep = False
        self._closed = False
        self.transformer_engine = self._use_transformer_engine()
        # prompts fed once per group: the local spec's SDPA takes their block masks (pipeline.py: `pad_rows`)
        self._share = config.share_prompts and not self.transformer_engine and config.attention == "sdpa"
        self._seed_rng(config.seed)
        self.policy = self._build(config.model.name)
        if config.lora is not None:  # adapters on the policy's linear layers; the base frozen (megatron/lora.py)
            check_lora(config.lora, moe=bool(self.policy.args.moe_layers), transformer_engine=self.transformer_engine,
                       sequence_parallel=par.sequence_parallel)
            apply_lora(self.policy, config.lora, tp_rank=self.ctx.tp_rank, tp_size=self.ctx.tp_size, seed=config.seed)
        self.params = list(self.policy.local_params())
        self.optim = OptimizerSet(
            self.params, config.optimizer, lr_lambda, ctx=self.ctx, distributed=par.distributed_optimizer
        )
        self.ref = None
        if config.ref is not None and config.lora is None:  # with LoRA the reference is the base: adapters off
            self.ref = self._build((config.ref.model or config.model).name)
            self.ref.module.requires_grad_(False)
        self.link = (
            StageLink(self.ctx.groups["pp"], self.ctx.pp_rank, self.ctx.pp_size, self.ctx.device)
            if self.ctx.pp_size > 1
            else None
        )
        tied_multi_stage = self.policy.layout.tie_word_embeddings and self.ctx.pp_size > 1
        self._tied = (
            frozenset({_EMBEDDING})
            if tied_multi_stage and (self.ctx.first_stage or self.ctx.last_stage)
            else frozenset()
        )
        self._norm_skip = (
            frozenset({_EMBEDDING}) if tied_multi_stage and not self.ctx.first_stage else frozenset()
        )
        self._info = self._describe()

    # -- building -------------------------------------------------------------------------------------

    def _use_transformer_engine(self) -> bool:
        spec = self.config.layer_spec
        on_cuda = self.ctx.device.type == "cuda"
        if spec == "local":
            return False
        try:
            import transformer_engine  # noqa: F401

            have_te = True
        except ImportError:
            have_te = False
        if spec == "transformer_engine" and not (on_cuda and have_te):
            raise ValueError(
                f"layer_spec='transformer_engine' needs CUDA and the transformer_engine package "
                f"(device {self.ctx.device}, transformer_engine {'found' if have_te else 'not installed'})"
            )
        return on_cuda and have_te

    def _seed_rng(self, seed: int) -> None:
        torch.manual_seed(seed)
        if self.ctx.device.type == "cpu":
            from tandem.engines.training.megatron.cpu_shim import install_cpu_globals

            install_cpu_globals(seed)
        else:
            from megatron.core import tensor_parallel

            tensor_parallel.model_parallel_cuda_manual_seed(seed)

    def _build(self, name: str) -> BuiltModel:
        cfg = self.config
        if cfg.parallel.sequence_parallel and not self.transformer_engine:
            raise ValueError(
                "sequence_parallel=True needs the TransformerEngine layer spec (CUDA + transformer_engine): "
                "Megatron's torch norms refuse sequence parallelism"
            )
        return build_model(
            resolve_model(name),
            self.ctx,
            dtype=DTYPES[cfg.model.dtype],
            parallel=cfg.parallel,
            transformer_engine=self.transformer_engine,
            deterministic=cfg.deterministic,
            vocab_divisible_by=cfg.vocab_divisible_by,
            extra_config=cfg.transformer_config,
            attention=cfg.attention,
        )

    def _describe(self) -> EngineInfo:
        """The policy forward as `EngineInfo` reports it (constant for the engine's life)."""
        cfg, args = self.config, self.policy.args
        return EngineInfo(
            name="megatron",
            version=_megatron_version(),
            dtype=cfg.model.dtype,
            deterministic=cfg.deterministic,
            moe_layers=tuple(args.moe_layers),
            max_context=args.max_position_embeddings,
            vocab_size=args.vocab_size,  # the model's, not Megatron's padded one
            can_sleep=self.ctx.device.type == "cuda",  # sleep moves weights off the GPU; a no-op on CPU
            temperature=cfg.temperature or 1.0,
            lora_adapters=cfg.lora is not None,
        )

    # -- data layout ----------------------------------------------------------------------------------

    @property
    def info(self) -> EngineInfo:
        return self._info

    @property
    def step(self) -> int:
        return self._step

    @property
    def dp_rank(self) -> int:
        return self.ctx.dp_rank

    @property
    def dp_size(self) -> int:
        return self.ctx.dp_size

    def local_rows(self, batch: TrainBatch) -> list[int]:
        """The rows of a global ``batch`` that this rank's data-parallel replica trains on."""
        return split_for_data_parallel(batch, self.ctx.dp_size, share_prompts=self._share)[self.ctx.dp_rank]

    def _check(self, batch: TrainBatch) -> None:
        check_batch(
            batch,
            max_context=self.policy.args.max_position_embeddings,
            micro_batch_tokens=self.config.micro_batch_tokens,
        )
        group = self.ctx.groups["model"]
        if dist.get_world_size(group) == 1:
            return
        # TP/PP peers compute one model replica together: they must see the same rows.
        w = torch.arange(1, batch.input_ids.shape[1] + 1, dtype=torch.float64)
        fingerprint = torch.tensor(
            [
                batch.batch_size,
                batch.input_ids.shape[1],
                float((batch.input_ids * w).sum()),
                float(batch.loss_mask.double().sum()),
            ],
            dtype=torch.float64,
        )
        lo = self.ctx.all_reduce(-fingerprint, "max", "model")
        hi = self.ctx.all_reduce(fingerprint, "max", "model")
        if not torch.equal(-lo, hi):
            raise ValueError(
                "tensor/pipeline-parallel peers were given different batches; give every rank of a "
                "model-parallel group the rows of its data-parallel rank (engine.local_rows(batch))"
            )

    def _stage_batches(
        self, batch: TrainBatch, plan: list[list[int]]
    ) -> list[tuple[TrainBatch | None, StageBatch]]:
        """``(rows' sub-batch or None for a stand-in, StageBatch)`` per micro-batch, in lockstep over the world.

        With expert parallelism the all-gather token dispatcher needs equal shapes on every rank, so
        micro-batch ``k`` is padded to the largest ``[rows, length]`` over the world; sequence
        parallelism needs the length to be a multiple of the TP size.
        """
        count = int(self.ctx.all_reduce(torch.tensor([len(plan)]), "max")[0])
        pieces = []
        for k in range(count):
            sub = batch.select(plan[k]) if k < len(plan) else None
            mb = make_micro_batch(sub, packed=self._share, share_prompts=self._share) if sub is not None else None
            if mb is None or not mb.targets.numel():
                sub, mb = None, dummy_micro_batch(packed=self._share, pad_token_id=batch.pad_token_id)
            pieces.append((sub, mb))
        shapes = torch.tensor([stage_shape(mb) for _, mb in pieces])  # [count, 2]
        if self.ctx.ep_size > 1:
            shapes = self.ctx.all_reduce(shapes, "max")
        out = []
        for (sub, mb), (rows, length) in zip(pieces, shapes.tolist(), strict=True):
            if self.config.parallel.sequence_parallel:
                length = math.ceil(length / self.ctx.tp_size) * self.ctx.tp_size
            out.append((sub, to_stage_batch(mb, rows, length, batch.pad_token_id, self.ctx.device,
                                            mask=self.transformer_engine or self.config.attention != "sdpa")))
        return out

    # -- forward pieces -------------------------------------------------------------------------------

    def _stage(self, built: BuiltModel, sb: StageBatch, input_tensor):
        return stage_forward(
            built.module,
            sb,
            input_tensor,
            first=self.ctx.first_stage,
            last=self.ctx.last_stage,
        )

    def _logprobs(self, built: BuiltModel, out: HeadInput, sb: StageBatch, with_entropy: bool):
        """``(log_probs [M], entropy [M] | None)`` of the selected positions (last stage), ``logprob_chunk`` rows
        of logits at a time."""
        return head_logprobs(
            out.hidden,
            out.weight,
            sb.targets,
            vocab_start=self.ctx.tp_rank * out.weight.shape[0],
            vocab_size=built.args.vocab_size,
            temperature=self.config.temperature,
            group=self.ctx.groups["tp"],
            with_entropy=with_entropy,
            chunk=self.config.logprob_chunk,
            sum_hidden_grad=not out.gathered,
        )

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("the Megatron engine is closed")

    def _module_for(self, model: Role) -> BuiltModel:
        self._check_open()
        if self._asleep:
            raise EngineAsleepError("the engine is asleep; call wake_up() first")
        if model == "policy":
            return self.policy
        if model == "ref":
            if self.ref is None and self.config.ref is not None:  # LoRA: the policy with its adapters off
                return self.policy
            if self.ref is None:
                raise ValueError("forward_logprobs(model='ref') but the engine has no reference (config.ref)")
            return self.ref
        if model == "critic":
            raise ValueError(
                "the Megatron engine has no critic; train PPO with a value model on the FSDP engine"
            )
        raise ValueError(f"model={model!r}: choose 'policy' or 'ref'")

    # -- protocol -------------------------------------------------------------------------------------

    def forward_logprobs(
        self, batch: TrainBatch, *, with_entropy: bool = False, model: Role = "policy"
    ) -> LogProbOutput:
        """Response-space ``[B, R]`` float32 log-probs (and entropy) of ``model``, no grad, zeros on padding."""
        warm_vector_math(self.ctx.device)  # Megatron's own rotary table: tandem/models/vector_math.py
        built = self._module_for(model)
        self._check(batch)
        plan = plan_micro_batches(batch, self.config.micro_batch_tokens, share_prompts=self._share, padded=True)
        width = int(batch.loss_mask.shape[1])
        out = torch.zeros(2, batch.batch_size, width)  # log-probs, entropy
        stage_batches = self._stage_batches(batch, plan)
        built.module.eval()

        def forward(k: int, inp):
            sub, sb = stage_batches[k]
            result = self._stage(built, sb, inp)
            if self.ctx.last_stage and sub is not None:
                lp, ent = self._logprobs(built, result, sb, with_entropy)
                index, r = torch.as_tensor(plan[k]), sb.source.response_shape[1]
                out[0, index, :r] = sb.source.to_response(lp.cpu())
                if ent is not None:
                    out[1, index, :r] = sb.source.to_response(ent.cpu())
            return result

        base = model == "ref" and self.ref is None  # LoRA's reference: the frozen base
        with torch.no_grad(), adapters_disabled(built.module) if base else contextlib.nullcontext():
            gpipe(len(stage_batches), forward, None, self.link)
        if self.ctx.pp_size > 1:
            out = self._from_last_stage(out)
        return LogProbOutput(log_probs=out[0], entropy=out[1] if with_entropy else None)

    def train_step(
        self, batch: TrainBatch, loss_fn: LossFn, *, model: Literal["policy"] = "policy"
    ) -> dict[str, float]:
        """One optimizer step over this rank's ``batch``; returns global metrics (see FSDPEngine.train_step).

        A NaN/Inf loss or gradient on any rank skips the step everywhere (``train/skipped_step = 1``).
        """
        if model != "policy":
            raise ValueError(f"cannot train model={model!r}: the Megatron engine trains the policy only")
        started = time.perf_counter()
        warm_vector_math(self.ctx.device)  # Megatron's own rotary table: tandem/models/vector_math.py
        stats = self._accumulate_gradients(batch, loss_fn)
        return self._finish_step(stats, started)

    def _accumulate_gradients(self, batch: TrainBatch, loss_fn: LossFn) -> _StepStats:
        """Forward + backward over all micro-batches; leaves this rank's (not yet reduced) gradients in ``.grad``."""
        built = self._module_for("policy")
        self._check(batch)
        scale = global_loss_scale(batch, lambda t, op: self.ctx.all_reduce(t, op, "dp"))
        plan = plan_micro_batches(batch, self.config.micro_batch_tokens, share_prompts=self._share, padded=True)
        stage_batches = self._stage_batches(batch, plan)
        built.module.train()
        self.optim.zero_grad()
        with_entropy = bool(getattr(loss_fn, "needs_entropy", False))
        stats = _StepStats()
        total = torch.zeros((), dtype=torch.float64)

        def forward(k: int, inp):
            stats.tokens += stage_batches[k][1].input_ids.numel()
            return self._stage(built, stage_batches[k][1], inp)

        def loss(k: int, head: HeadInput) -> torch.Tensor:
            nonlocal total
            sub, sb = stage_batches[k]
            lp, ent = self._logprobs(built, head, sb, with_entropy)
            if sub is None:
                value = lp.sum() * 0.0
            else:
                src = sb.source
                output = LogProbOutput(
                    log_probs=src.to_response(lp), entropy=src.to_response(ent) if ent is not None else None
                )
                value, metrics = loss_fn(output, sub.to(self.ctx.device), scale)
                if not value.requires_grad:  # a constant loss still has to run the backward collectives
                    value = value + lp.sum() * 0.0
                stats.metrics = reduce_micro_batch_metrics([stats.metrics, metrics_to_floats(metrics)])
            total += value.detach().double().cpu()
            return value

        gpipe(len(stage_batches), forward, loss, self.link)
        stats.loss = float(total)
        return stats

    def _finish_step(self, stats: _StepStats, started: float) -> dict[str, float]:
        """Reduce gradients, agree on skipping, clip, step AdamW and the LR schedule; build the metrics."""
        ctx = self.ctx
        reduce_gradients(
            self.params,
            dp_group=ctx.groups["dp"],
            expert_dp_group=ctx.groups["expert_dp"],
            tp_group=ctx.groups["tp"],
            sequence_parallel=self.config.parallel.sequence_parallel,
            embedding_group=ctx.groups.get("embedding"),
            tied_names=self._tied,
        )
        norm_t = global_grad_norm(
            self.params,
            tp_rank=ctx.tp_rank,
            etp_rank=dist.get_rank(ctx.groups["etp"]),
            model_group=ctx.groups["model"],
            expert_model_group=ctx.groups["expert_model"],
            skip=self._norm_skip,
            device=ctx.device,
        )
        reporter = ctx.last_stage and ctx.tp_rank == 0  # one report per data-parallel replica
        mine = (stats.loss, stats.metrics) if reporter else None
        everyone = [g for g in ctx.all_gather_object((mine, stats.tokens)) if g[0] is not None]
        global_loss = sum(g[0][0] for g in everyone)
        norm = float(norm_t)
        skipped = step_skipped(global_loss, norm)
        lr = self.optim.lr
        if not skipped:
            self.optim.clip(norm_t, self.config.optimizer.grad_clip)
            self.optim.step()
        self.optim.zero_grad()
        self.optim.schedule_step()
        self._step += 1
        return step_metrics(
            "train",
            loss=global_loss,
            grad_norm=norm,
            lr=lr,
            skipped=skipped,
            tokens=sum(g[1] for g in everyone),
            started=started,
            rank_metrics=(g[0][1] for g in everyone),
            device=ctx.device,
        )

    def named_parameters_for_sync(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """HF-named full policy weights in buckets of at most ``bucket_bytes`` (collective: drain on every rank).

        With LoRA: the adapters alone under peft's names (``lora.sync == "adapter"``), or the HF weights with
        the adapters merged (peft's ``W + B @ A * alpha / rank``)."""
        self._check_open()
        lora = self.config.lora
        if lora is None:
            named = hf_tensors(self.policy, self.ctx, self._dtype)
        elif lora.sync == "adapter":
            named = hf_tensors(self.policy, self.ctx, self._dtype, rules=self._adapter_rules())
        else:
            adapters = dict(hf_tensors(self.policy, self.ctx, self._dtype, rules=self._adapter_rules()))
            named = merge_into(hf_tensors(self.policy, self.ctx, self._dtype), adapters, lora.alpha / lora.rank)
        yield from bucket_by_bytes(named, bucket_bytes)

    def save(self, path: str) -> None:
        """DCP checkpoint: weights, optimizer, LR schedule, RNG, step (collective)."""
        self._check_open()
        meta = {
            "step": self._step,
            "model": dataclasses.asdict(self.config.model),
            "model_path": self.policy.path,
            "layout": self._layout(),
            "data_parallel": self.ctx.dp_size,
            "has_optimizer_state": self.optim.has_state(),
            "lora": dataclasses.asdict(self.config.lora) if self.config.lora else None,
        }
        ckpt.save_checkpoint(
            path,
            params=self._ckpt_params(),
            owned=self.optim.owned(),
            optimizer_state=self.optim.state(),
            masters=self.optim.masters(),
            schedulers=self.optim.scheduler_states(),
            rank=self.ctx.rank,
            metadata=meta,
        )

    def load(self, path: str) -> None:
        self._check_open()
        meta = ckpt.load_checkpoint(
            path,
            params=self._ckpt_params(),
            owned=self.optim.owned(),
            optimizer_state=self.optim.state(),
            masters=self.optim.masters(),
            layout=self._layout(),
            rank=self.ctx.rank,
        )
        self.optim.load_scheduler_states(meta["schedulers"], stepped=bool(meta["has_optimizer_state"]))
        self._step = int(meta["step"])

    def sleep(self) -> None:
        """Move weights and optimizer state to CPU (a no-op on a CPU device)."""
        self._move(torch.device("cpu"))
        self._asleep = True

    def wake_up(self) -> None:
        self._move(self.ctx.device)
        self._asleep = False

    def close(self) -> None:
        """Release Megatron's parallel state (and the process group if the engine created it) once the
        last engine of this layout closes. Idempotent; afterwards every other call raises
        `EngineClosedError`."""
        self._closed = True
        self.ctx.close()

    # -- internals ------------------------------------------------------------------------------------

    @property
    def _dtype(self) -> torch.dtype:
        return DTYPES[self.config.model.dtype]

    def _layout(self) -> dict[str, int]:
        p = self.config.parallel
        return {
            "tensor_parallel": p.tensor_parallel,
            "pipeline_parallel": p.pipeline_parallel,
            "expert_parallel": p.expert_parallel,
            "expert_tensor_parallel": p.expert_tensor_parallel,
        }

    def _ckpt_params(self) -> list[tuple[str, torch.nn.Parameter]]:
        tp = (self.ctx.tp_rank, self.ctx.tp_size)
        etp_group = self.ctx.groups["etp"]
        etp = (dist.get_rank(etp_group), dist.get_world_size(etp_group))
        # LoRA: the adapters alone; the frozen base is the model folder's, rebuilt by the engine
        return [(ckpt.shard_key(name, rule.split, rule.expert, tp, etp), p) for name, rule, p in self.params
                if p.requires_grad or self.config.lora is None]

    def _adapter_rules(self) -> list:
        """The rules of every adapter of the whole model (global names, in layer order): peft-named exports."""
        return [r for name, r in self.policy.rules.items() if ".lora." in name]

    def _from_last_stage(self, t: torch.Tensor) -> torch.Tensor:
        """Broadcast a CPU tensor from the last pipeline stage to every stage of this rank's pipeline."""
        group = self.ctx.groups["pp"]
        moved = t.to(self.ctx.device)
        dist.broadcast(moved, src=dist.get_global_rank(group, self.ctx.pp_size - 1), group=group)
        return moved.cpu()

    def _move(self, device: torch.device) -> None:
        if self.ctx.device.type == "cpu":
            return
        for built in (self.policy, self.ref):
            if built is not None:
                built.module.to(device)
        self.optim.move_state(device)
        if device.type == "cpu":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
