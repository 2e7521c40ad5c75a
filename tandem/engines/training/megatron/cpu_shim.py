"""The places where megatron-core assumes CUDA, redirected to the CPU. Applied only on CPU.

Measured on megatron-core 0.16.1 with the local (non-TransformerEngine) layer spec:

* **RNG tracker.** ``model_parallel_cuda_manual_seed`` seeds CUDA generators, and every attention
  forward enters ``get_cuda_rng_tracker().fork()`` around its (zero-probability) dropout, which reads and
  writes the CUDA RNG state. `install_cpu_rng_tracker` puts a tracker with the same seeds and names
  (data-parallel, model-parallel = seed + 2718 + tp_rank, expert-parallel) on the CPU generator in
  Megatron's tracker slot, so ``fork()`` swaps CPU generator states instead.
* **Scratch buffer.** ``parallel_state``'s global memory buffer (used for attention scores) allocates
  on ``torch.cuda.current_device()``; `install_cpu_memory_buffer` puts one that allocates on the CPU in
  its slot.
* **Rotary tables.** ``RotaryEmbedding.get_emb`` moves ``inv_freq`` to ``torch.cuda.current_device()``
  the first time it runs. `keep_rotary_on_cpu` replaces that method on the one instance by the same
  table computation without the move.
* **MoE router.** ``Router.gating`` moves the router weight to CUDA on every call; `keep_router_on_cpu`
  replaces it on each router instance by the same product as a plain ``F.linear`` (Megatron's version
  also calls TransformerEngine's GEMM).
* **Expert-parallel gathers.** The MoE token dispatcher gathers tokens with
  ``mappings._gather_along_first_dim`` / ``_reduce_scatter_along_first_dim``, which allocate on CUDA;
  `route_gathers_to_cpu` swaps in versions that run the same gloo collectives into CPU tensors. This is
  the one process-wide replacement (a CPU engine has no CUDA path to keep).

Nothing else is patched: every other module keeps Megatron's own code. On a CUDA device none of these
is installed (`apply_cpu_shims` refuses to run there).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = [
    "apply_cpu_shims",
    "cpu_rotary_emb",
    "cpu_router_gating",
    "install_cpu_globals",
    "install_cpu_memory_buffer",
    "install_cpu_rng_tracker",
    "keep_rotary_on_cpu",
    "keep_router_on_cpu",
    "route_gathers_to_cpu",
]

_SEED_OFFSET = 2718  # Megatron's tensor-parallel seed offset (model_parallel_cuda_manual_seed)


def _tracker_class():
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    class CpuRNGStatesTracker(CudaRNGStatesTracker):
        """Megatron's named RNG states, kept as CPU generator states."""

        def add(self, name: str, seed: int) -> None:
            if seed in self.seeds_:
                raise ValueError(f"RNG seed {seed} is already tracked")
            if name in self.states_:
                raise ValueError(f"RNG state {name!r} is already tracked")
            self._is_initialized = True
            self.seeds_.add(seed)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                self.states_[name] = torch.get_rng_state()

        @contextlib.contextmanager
        def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
            if name not in self.states_:
                raise KeyError(f"RNG state {name!r} was never added (call install_cpu_rng_tracker first)")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    return CpuRNGStatesTracker


def install_cpu_rng_tracker(seed: int) -> None:
    """Megatron's ``model_parallel_cuda_manual_seed(seed)`` on the CPU generator (after model-parallel init)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    tracker = _tracker_class()()
    torch.manual_seed(seed)
    tracker.add(mrandom.get_data_parallel_rng_tracker_name(), seed)
    tracker.add("model-parallel-rng", seed + _SEED_OFFSET + ps.get_tensor_model_parallel_rank())
    expert_seed = (
        seed + 1024 + 100 * ps.get_expert_model_parallel_rank() + ps.get_expert_tensor_parallel_rank()
    )
    tracker.add(mrandom.get_expert_parallel_rng_tracker_name(), expert_seed)
    # Megatron builds its tracker lazily into these module globals; filling them first makes every
    # get_cuda_rng_tracker() call return this one.
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def install_cpu_memory_buffer() -> None:
    """Megatron's global scratch buffer, allocating on the CPU (after model-parallel init)."""
    from megatron.core import parallel_state as ps
    from megatron.core.utils import GlobalMemoryBuffer

    class CpuMemoryBuffer(GlobalMemoryBuffer):
        """Scratch tensors on the CPU. Their users (``baddbmm`` with ``beta=0``, all-gather outputs)
        overwrite them, so a fresh allocation per call is as good as a reused one."""

        def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
            return torch.empty(tuple(tensor_shape), dtype=dtype)

    ps._GLOBAL_MEMORY_BUFFER = CpuMemoryBuffer()


def install_cpu_globals(seed: int) -> None:
    """The CPU RNG tracker and scratch buffer in Megatron's global slots (after model-parallel init)."""
    install_cpu_rng_tracker(seed)
    install_cpu_memory_buffer()


def cpu_rotary_emb(rotary, max_seq_len: int, offset: int = 0) -> torch.Tensor:
    """``RotaryEmbedding.get_emb`` without the move to CUDA: ``[max_seq_len, 1, 1, rotary_dim]``."""
    freqs = rotary.get_freqs_non_repeated(max_seq_len, offset)  # [S, rotary_dim / 2]
    if rotary.rotary_interleaved:
        emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
    else:
        emb = torch.cat((freqs, freqs), dim=-1)
    return emb[:, None, None, :]


def keep_rotary_on_cpu(model: torch.nn.Module) -> int:
    """Give every Megatron ``RotaryEmbedding`` in ``model`` the CPU ``get_emb``; returns how many."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    count = 0
    for module in model.modules():
        if type(module) is RotaryEmbedding:  # subclasses (YaRN, mRoPE) compute other tables
            module.get_emb = lambda max_seq_len, offset=0, _m=module: cpu_rotary_emb(_m, max_seq_len, offset)
            count += 1
    return count


def cpu_router_gating(router, x: torch.Tensor) -> torch.Tensor:
    """``Router.gating`` on the CPU: logits ``[N, experts]`` in the router dtype.

    Megatron's gating moves the weight to CUDA and multiplies with TransformerEngine's GEMM; a plain
    ``F.linear`` in the router dtype computes the same product.
    """
    dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(router.config.moe_router_dtype, x.dtype)
    bias = router.bias.to(dtype) if router.bias is not None else None
    return torch.nn.functional.linear(x.to(dtype), router.weight.to(dtype), bias)


def keep_router_on_cpu(model: torch.nn.Module) -> int:
    """Give every MoE router in ``model`` the CPU ``gating``; returns how many."""
    from megatron.core.transformer.moe.router import Router

    count = 0
    for module in model.modules():
        if isinstance(module, Router):
            module.gating = lambda x, _m=module: cpu_router_gating(_m, x)
            count += 1
    return count


def _cpu_gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
    """``mappings._gather_along_first_dim`` allocating its output beside the input (``[sum(n_i), ...]``)."""
    import torch.distributed as dist

    world = group.size()
    if world == 1:
        return input_
    if output_split_sizes is None:
        output = input_.new_empty((input_.shape[0] * world, *input_.shape[1:]))
        dist.all_gather_into_tensor(output, input_.contiguous(), group=group)
        return output
    output = input_.new_empty((sum(output_split_sizes), *input_.shape[1:]))
    dist.all_gather(list(torch.split(output, output_split_sizes, dim=0)), input_.contiguous(), group=group)
    return output


def _cpu_reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
    """``mappings._reduce_scatter_along_first_dim`` allocating its output beside the input."""
    import torch.distributed as dist

    world = group.size()
    if world == 1:
        return input_
    if input_split_sizes is None:
        if input_.shape[0] % world:
            raise ValueError(f"first dimension {input_.shape[0]} does not split over {world} ranks")
        output = input_.new_empty((input_.shape[0] // world, *input_.shape[1:]))
        dist.reduce_scatter_tensor(output, input_.contiguous(), group=group)
        return output
    pieces = [t.contiguous() for t in torch.split(input_, input_split_sizes, dim=0)]
    output = torch.empty_like(pieces[group.rank()])
    dist.reduce_scatter(output, pieces, group=group)
    return output


def route_gathers_to_cpu() -> None:
    """Make Megatron's sequence/expert-parallel all-gather and reduce-scatter allocate on the CPU.

    The token dispatcher of an expert-parallel MoE layer calls these two module-level functions of
    ``megatron.core.tensor_parallel.mappings``, which allocate their outputs on
    ``torch.cuda.current_device()``; the replacements run the same collectives into CPU tensors.
    Process-wide and idempotent: a process whose engine runs on the CPU has no CUDA path to keep.
    """
    from megatron.core.tensor_parallel import mappings

    mappings._gather_along_first_dim = _cpu_gather_along_first_dim
    mappings._reduce_scatter_along_first_dim = _cpu_reduce_scatter_along_first_dim


def apply_cpu_shims(model: torch.nn.Module, device: torch.device) -> None:
    """Make a Megatron model built with ``use_cpu_initialization`` run forward/backward on the CPU."""
    if device.type != "cpu":
        raise ValueError(f"the CPU shims are for device 'cpu' only, not {device}")
    keep_rotary_on_cpu(model)
    keep_router_on_cpu(model)
    route_gathers_to_cpu()
