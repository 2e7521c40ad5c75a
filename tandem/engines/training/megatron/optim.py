"""AdamW over one rank's Megatron parameters: fp32 master weights, optionally ZeRO-1 sharded.

**Master weights.** A bf16/fp16 model trains like Megatron's mixed-precision optimizer: AdamW updates
an fp32 copy of every low-precision parameter (its gradient cast to fp32), and the model parameter is
the master rounded to the model dtype after each step. Updates smaller than a bf16 ulp accumulate in
the master instead of vanishing. fp32 parameters are their own masters.

**Sharding.** Megatron's ``DistributedOptimizer`` needs its CUDA-only ``DistributedDataParallel`` grad
buffers, so the sharded variant is torch's ``ZeroRedundancyOptimizer``: each replica keeps AdamW's
moments for a partition of the masters, steps them, and broadcasts the new values to the other
replicas. Dense parameters are partitioned over the data-parallel group and expert parameters over the
expert-data-parallel group (their replicas), each with its own LR schedule driven by the same
``lr_lambda``. Either way the update equals one AdamW over all parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from tandem.engines.training.common.config import OptimizerConfig
from tandem.engines.training.megatron.convert import Rule
from tandem.engines.training.megatron.parallel import MegatronContext

__all__ = ["OptimizerSet"]


def _constant(step: int) -> float:
    return 1.0


class OptimizerSet:
    """The optimizers (one, or one ZeRO per replica group), LR schedulers and masters of the trainable parameters."""

    def __init__(
        self,
        params: Sequence[tuple[str, Rule, torch.nn.Parameter]],
        cfg: OptimizerConfig,
        lr_lambda: Callable[[int], float] | None,
        *,
        ctx: MegatronContext,
        distributed: bool,
    ) -> None:
        trainable = [(r, p) for _, r, p in params if p.requires_grad]
        self.params = [p for _, p in trainable]
        # model parameter id -> its fp32 master (the parameter itself when it is fp32)
        self.main = {
            id(p): p if p.dtype == torch.float32 else p.detach().float().clone() for p in self.params
        }
        kw = dict(lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay, fused=True)
        if distributed:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            dense = [self.main[id(p)] for r, p in trainable if not r.expert]
            expert = [self.main[id(p)] for r, p in trainable if r.expert]
            groups = ((dense, ctx.groups["dp"]), (expert, ctx.groups["expert_dp"]))
            self.optimizers = [
                ZeroRedundancyOptimizer(ps, optimizer_class=torch.optim.AdamW, process_group=g, **kw)
                for ps, g in groups
                if ps
            ]
            self._inner = [o.optim for o in self.optimizers]
        else:
            self.optimizers = [torch.optim.AdamW([self.main[id(p)] for p in self.params], **kw)]
            self._inner = self.optimizers
        self.schedulers = [
            torch.optim.lr_scheduler.LambdaLR(o, lr_lambda or _constant) for o in self.optimizers
        ]
        self._owner = {id(m): inner for inner in self._inner for g in inner.param_groups for m in g["params"]}
        self._stepped = False

    @property
    def lr(self) -> float:
        return float(self.schedulers[0].get_last_lr()[0])

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
            self.main[id(p)].grad = None

    def clip(self, total_norm: torch.Tensor, max_norm: float) -> None:
        """Scale gradients by ``max_norm / total_norm`` when above (``max_norm <= 0``: no clipping)."""
        grads = [p for p in self.params if p.grad is not None]
        if max_norm > 0 and grads:
            torch.nn.utils.clip_grads_with_norm_(grads, max_norm, total_norm.to(grads[0].device))

    @torch.no_grad()
    def step(self) -> None:
        for p in self.params:
            master = self.main[id(p)]
            if master is not p:
                master.grad = p.grad.float() if p.grad is not None else None
        for o in self.optimizers:
            o.step()
        for p in self.params:
            master = self.main[id(p)]
            if master is not p:  # ZeRO broadcast every master, so each rank rounds all of them
                p.copy_(master)
        self._stepped = True

    def schedule_step(self) -> None:
        for s in self.schedulers:
            s.step()

    # -- state ------------------------------------------------------------------------------------------

    def owned(self) -> set[int]:
        """Ids of the model parameters whose AdamW state this rank keeps."""
        return {id(p) for p in self.params if id(self.main[id(p)]) in self._owner}

    def masters(self) -> dict[int, torch.Tensor]:
        """Model parameter id -> its separate fp32 master (low-precision parameters only)."""
        return {id(p): m for p in self.params if (m := self.main[id(p)]) is not p}

    def state(self) -> _StateView:
        return _StateView(self.main, self._owner)

    def has_state(self) -> bool:
        return self._stepped

    def scheduler_states(self) -> list[dict]:
        return [s.state_dict() for s in self.schedulers]

    def load_scheduler_states(self, states: list[dict], *, stepped: bool) -> None:
        if len(states) != len(self.schedulers):
            raise ValueError(
                f"checkpoint holds {len(states)} LR schedulers, this engine has {len(self.schedulers)}"
            )
        for s, st in zip(self.schedulers, states, strict=True):
            s.load_state_dict(st)
            # A scheduler's state does not include the optimizer's current LR; put it back.
            for group, lr in zip(s.optimizer.param_groups, s.get_last_lr(), strict=True):
                group["lr"] = lr
        self._stepped = stepped

    def move_state(self, device: torch.device) -> None:
        for p in self.params:
            master = self.main[id(p)]
            if master is not p:
                master.data = master.data.to(device, non_blocking=True)
        for inner in self._inner:
            for st in inner.state.values():
                for k, v in st.items():
                    if isinstance(v, torch.Tensor):  # fused AdamW keeps its step counter beside the params
                        st[k] = v.to(device, non_blocking=True)


class _StateView:
    """``model param -> AdamW state dict`` of its master, across the inner optimizers (live, created on demand)."""

    def __init__(self, main: dict, owner: dict) -> None:
        self._main, self._owner = main, owner

    def get(self, p: torch.nn.Parameter, default=None):
        master = self._main[id(p)]
        inner = self._owner.get(id(master))
        if inner is None or master not in inner.state:
            return default
        return inner.state[master]

    def setdefault(self, p: torch.nn.Parameter, default: dict) -> dict:
        master = self._main[id(p)]
        return self._owner[id(master)].state.setdefault(master, default)
