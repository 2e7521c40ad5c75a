"""Native CPU kernels: small C sources built with the system's C compiler on first use, called by ctypes.

Why C and not torch ops. A decode step's attention is, per sequence and key head, a handful of query rows
(the group's heads) against that sequence's keys: ``[G, D] x [D, L]`` then ``[G, L] x [L, D]``. torch runs
that as two batched products of ``sequences x kv_heads`` tiny matrices, and oneDNN spends ~2 us of set-up
per matrix on them (SmolLM2-135M, 64 sequences: 192 matrices per product, ~21 ms of a 103 ms decode step
at ~14 GFLOP/s, docs/benchmarks.md). The loop below reads each key and value row once, straight from the
cache slots, and keeps the scores of one (sequence, head) in a thread's buffer: it is bound by reading the
keys and values, as decode attention should be (with AVX-512: 16 keys a block, a transpose-add tree for
their scores, a vector softmax; csrc/decode_attention.c; with AVX2 alone, the same in 8-lane vectors,
csrc/decode_attention_avx2.h). It also writes the step's
own keys and values into the cache when asked (`new_k`, `new_v`), which torch's ``index_copy_`` did at
~90 us a layer on cold cache lines. SDPA's CPU flash kernel does not help here: it costs ~60 us per call
and tiles for long query blocks.

The second kernel, ``csrc/sample.c``, draws a token per row from float32 logits (temperature, inverse CDF
from the row's own uniform number, the token's log-prob): three passes over a row where the torch sampler
makes five, each allocating (64 rows x 49,152 logits: ~8 ms -> ~1.5 ms a decode step, docs/inference.md).
The third, ``csrc/pack.c``, writes a linear weight into the memory of its oneDNN-packed copy (a blocked
transpose, near memcpy's rate; oneDNN's reorder allocates anew and runs at a quarter of it), optionally
copying it into the plain weight in the same pass: a weight sync into a packing engine (tandem/ops/linear.py).
The fourth, ``csrc/pointwise.c``, runs RMSNorm, rotary embedding and SwiGLU in one pass each instead of
~25 small torch ops per layer (tandem/models/lean_ops.py calls it inside `pointwise_kernels`), and their
backward passes for the trainer (inside `lean_ops.backward_kernels`: SwiGLU's backward is ~9 torch ops over
[tokens, 1536] operands a layer; its reductions run in an order that does not depend on the thread count).

The fifth, ``csrc/dequant.c``, turns block-FP8 codes back into float32 weights in one pass, the same bits as the
torch reference (tandem/kernels/fp8.py uses it on CPU: a QLoRA base is dequantized in every forward and backward).

The sixth, ``csrc/skinny.c``, multiplies a few float32 (or, with AVX-512 BF16, bfloat16) rows, a decode step's,
by a weight in its oneDNN-packed layout, reading each 64-output block of it once per 6 rows: decode-sized
products at 1.1-2x oneDNN's speed (tandem/ops/linear.py, "Few-row products").

Build. `load(name)` compiles ``csrc/<name>.c`` with ``cc -O3 -march=native -ffast-math -fopenmp -c`` and links it
without fast math (which would set flush-to-zero for the whole process) into the kernel cache
(``$TANDEM_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/tandem/kernels``, else ``~/.cache/tandem/kernels``),
under a name that hashes the source, the compiler's version and this CPU's flags, so a changed source,
compiler or machine builds anew; the library is written to a temporary file and renamed into place
(two processes building at once both succeed). The cache holds code Tandem loads and runs: it is created
private to the user (mode 0700); point ``TANDEM_KERNEL_CACHE`` only at a folder nobody else can write.
OpenMP comes from the ``libgomp.so.1`` torch already
loaded, so the kernel's threads are torch's threads (``torch.set_num_threads`` applies). Without a
compiler, or when the build fails, `load()` returns None once with a logged reason, and callers keep
their torch path. ``TANDEM_NATIVE_KERNELS=0`` turns every native kernel off.

Numerics. Normal (non-deterministic) mode only: the sums run in a different order than oneDNN's, so
results differ from the torch path by float rounding (~1e-6 relative in fp32). The deterministic mode's
batch-invariant attention (`tandem.ops.batch_invariant`) is never replaced.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

__all__ = ["NativeKernelError", "choose", "cpu_has_native_bf16", "decode_attention", "dequant_fp8_block",
           "kernel_cache_dir", "load", "load_variant", "native_enabled",
           "pack_b64", "rms_norm", "rms_norm_backward", "rotary", "rotary_backward", "sample", "swiglu",
           "swiglu_backward"]

log = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
# Compile with fast math (vectorised expf, reassociated sums) but link without it: a link with -ffast-math
# adds crtfastmath.o, whose constructor sets flush-to-zero / denormals-are-zero for the whole process
# (every float op of torch and numpy afterwards), so compiling and linking are two commands.
_COMPILE = ["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fopenmp", "-fPIC", "-c"]
_LINK = ["-shared", "-fopenmp", "-lm"]
_MAX_GROUP, _MAX_HEAD_DIM = 16, 256  # the kernel's limits (csrc/decode_attention.c)
_lock = threading.Lock()
_libs: dict[str, ctypes.CDLL | None] = {}


class NativeKernelError(RuntimeError):
    """A native kernel that was asked for explicitly could not be built or loaded."""


def native_enabled() -> bool:
    return os.environ.get("TANDEM_NATIVE_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off")


def kernel_cache_dir() -> Path:
    env = os.environ.get("TANDEM_KERNEL_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tandem" / "kernels"


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return os.uname().machine


def cpu_has_native_bf16() -> bool:
    """Whether this CPU has bf16 dot-product instructions (x86 ``avx512_bf16`` or ``amx_bf16``, Arm ``bf16``):
    there bf16 matrix products run ~2.5x fp32's (measured on an AVX512-BF16 EPYC); elsewhere they are emulated."""
    flags = set(_cpu_flags().split())
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def _build(name: str, march: str = "native", defines: tuple[str, ...] = ()) -> Path:
    """Compile ``csrc/<name>.c`` into the cache (or find it there); raises NativeKernelError. ``march``: the
    target (``-march=``); another than ``native`` builds a variant, such as the AVX2 one on an AVX-512 CPU
    (`load_variant`); ``defines``: preprocessor macros of a variant (``-D<name>``)."""
    if not sys.platform.startswith("linux"):
        raise NativeKernelError(f"native kernels are built on Linux only (this is {sys.platform})")
    cc = _compiler()
    if cc is None:
        raise NativeKernelError("no C compiler found (cc, gcc, clang or $CC): install one, e.g. apt install gcc")
    source = (_CSRC / f"{name}.c").read_bytes() + b"".join(h.read_bytes() for h in sorted(_CSRC.glob("*.h")))
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise NativeKernelError(f"{cc} --version failed: {e}") from e
    compile_flags = [f"-march={march}" if f == "-march=native" else f for f in _COMPILE] + [f"-D{d}" for d in defines]
    key = hashlib.sha256(source + version.encode() + _cpu_flags().encode()
                         + " ".join(compile_flags + _LINK).encode())
    cache = kernel_cache_dir()
    target = cache / f"lib{name}-{key.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    try:
        cache.mkdir(mode=0o700, parents=True, exist_ok=True)  # it holds code this process loads: the user's own
    except OSError as e:
        raise NativeKernelError(f"kernel cache {cache} is not writable: {e} (set TANDEM_KERNEL_CACHE)") from e
    fd, tmp = tempfile.mkstemp(prefix=f".{name}-", suffix=".so", dir=cache)
    os.close(fd)
    obj = tmp[: -len(".so")] + ".o"
    try:
        for cmd in ([cc, *compile_flags, str(_CSRC / f"{name}.c"), "-o", obj], [cc, obj, *_LINK, "-o", tmp]):
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                raise NativeKernelError(f"building {name} failed ({' '.join(cmd)}):\n{done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)  # atomic: a concurrent build of the same key writes the same bytes
    except subprocess.SubprocessError as e:
        raise NativeKernelError(f"building {name} failed: {e}") from e
    finally:
        for path in (tmp, obj):
            if os.path.exists(path):
                os.unlink(path)
    log.info("built native kernel %s: %s", name, target)
    return target


def load(name: str = "decode_attention", *, required: bool = False) -> ctypes.CDLL | None:
    """The loaded library of kernel ``name``; None when native kernels are off or it cannot be built
    (the reason is logged once), or NativeKernelError with the reason when ``required``."""
    with _lock:
        if name in _libs and (_libs[name] is not None or not required):
            return _libs[name]
        if not native_enabled():
            reason = "TANDEM_NATIVE_KERNELS=0"
            if required:
                raise NativeKernelError(f"native kernel {name} asked for, but {reason}")
            _libs[name] = None
            return None
        try:
            lib = ctypes.CDLL(str(_build(name)))
        except (NativeKernelError, OSError) as e:
            if required:
                raise NativeKernelError(str(e)) from e
            log.warning("native kernel %s unavailable, using the torch path: %s", name, e)
            _libs[name] = None
            return None
        _bind(name, lib)
        _libs[name] = lib
        return lib


def load_variant(name: str, march: str = "native", defines: tuple[str, ...] = ()) -> ctypes.CDLL:
    """Kernel ``name`` built for ``-march=<march>`` with the macros ``defines`` (not cached in-process, not used
    by the engine): a test or bench compares the code paths of two instruction sets on one CPU (x86-64-v3: AVX2
    + FMA; this CPU must run them), or a kernel's fallback (decode_attention with
    ``TANDEM_PORTABLE_ATTENTION``: the portable loop). Raises NativeKernelError when it cannot be built."""
    try:
        lib = ctypes.CDLL(str(_build(name, march, defines)))
    except OSError as e:
        raise NativeKernelError(str(e)) from e
    _bind(name, lib)
    return lib


def choose(name: str, choice: str, device, deterministic: bool) -> ctypes.CDLL | None:
    """Kernel ``name`` for a part set to ``choice`` (auto | native | torch), or None for the torch path: never
    on GPU nor in a deterministic mode (its batch-invariant ops are the contract). ``native`` raises
    `NativeKernelError` when it cannot be built."""
    if choice == "torch" or getattr(device, "type", device) != "cpu" or deterministic:
        return None
    return load(name, required=choice == "native")


def _bind(name: str, lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    if name == "decode_attention":
        for fn in (lib.tandem_decode_attention_f32, lib.tandem_decode_attention_bf16):
            fn.restype = ctypes.c_int
            fn.argtypes = [ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64,
                           ctypes.c_float, i64]
        lib.tandem_decode_attention_vector_bits.restype = ctypes.c_int
        lib.tandem_decode_attention_vector_bits.argtypes = []
    elif name == "sample":
        lib.tandem_sample_f32.restype = ctypes.c_int
        lib.tandem_sample_f32.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, ptr]
    elif name == "pointwise":
        lib.tandem_rms_norm.restype = lib.tandem_swiglu.restype = lib.tandem_rotary.restype = None
        lib.tandem_rms_norm.argtypes = [ptr, ptr, ptr, i64, i64, ctypes.c_float, ctypes.c_int]
        lib.tandem_swiglu.argtypes = [ptr, ptr, ptr, i64, ctypes.c_int]
        lib.tandem_rotary.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, ctypes.c_int]
        lib.tandem_swiglu_backward.restype = lib.tandem_rms_norm_backward.restype = None
        lib.tandem_rotary_backward.restype = None
        lib.tandem_swiglu_backward.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, ctypes.c_int]
        lib.tandem_rms_norm_backward.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, ctypes.c_int]
        lib.tandem_rotary_backward.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, ctypes.c_int]
        lib.tandem_rms_block.restype = i64
        lib.tandem_rms_block.argtypes = []
    elif name == "dequant":
        lib.tandem_dequant_fp8_block.restype = None
        lib.tandem_dequant_fp8_block.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, i64]
    elif name == "pack":
        for fn in (lib.tandem_pack_b64, lib.tandem_pack_b16):
            fn.restype = ctypes.c_int
            fn.argtypes = [ptr, ptr, ptr, i64, i64]
    elif name == "skinny":
        for fn in (lib.tandem_skinny_f32, lib.tandem_skinny16_f32, lib.tandem_skinny_bf16):
            fn.restype = ctypes.c_int
            fn.argtypes = [ptr, i64, i64, ptr, i64, ptr, ptr]
        lib.tandem_skinny_vector_bits.restype = ctypes.c_int
        lib.tandem_skinny_vector_bits.argtypes = []


def supports(group: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `decode_attention` takes ``group`` query heads per key head of ``head_dim`` in ``dtype``."""
    return (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and 1 <= group <= _MAX_GROUP and 1 <= head_dim <= _MAX_HEAD_DIM)


def decode_attention(lib: ctypes.CDLL, q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                     slots: torch.Tensor, limit: torch.Tensor, scale: float, max_len: int | None = None,
                     new_k: torch.Tensor | None = None, new_v: torch.Tensor | None = None) -> torch.Tensor:
    """Row ``r`` of ``q [R, Hkv, G, D]`` attends over slot ``slots[r]`` of ``cache_k, cache_v [slots, Hkv, L,
    D]`` (one layer of the cache, or a strided view of it; the last dimension contiguous), positions
    ``< limit[r]`` (``1 <= limit[r] <= max_len <= L``) -> ``[R, Hkv, G, D]`` in the cache's dtype; scores,
    softmax and sums in fp32. ``slots`` and ``limit`` are int64 CPU tensors; ``max_len`` defaults to the
    largest limit (it sizes the threads' score buffers). With ``new_k, new_v [R, Hkv, D]`` (the cache's
    dtype), row ``r``'s own key and value are first written into the cache at position ``limit[r] - 1`` of
    its slot, every row's before any row reads (the kernel does the cache write of a step)."""
    r, hkv, g, d = q.shape
    if cache_k.stride(-1) != 1 or cache_v.stride(-1) != 1:
        raise ValueError("decode_attention: keys and values need a contiguous last dimension")
    if cache_k.dtype != cache_v.dtype or cache_k.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"decode_attention: keys/values dtype {cache_k.dtype}/{cache_v.dtype}: fp32 or bf16, equal")
    if slots.dtype != torch.int64 or limit.dtype != torch.int64 or len(slots) != r or len(limit) != r:
        raise ValueError(f"decode_attention: slots and limit must be int64 with {r} entries")
    if max_len is None:
        max_len = int(limit.max()) if r else 1
    if max_len > cache_k.shape[2]:
        raise ValueError(f"decode_attention: max_len={max_len} exceeds the {cache_k.shape[2]} cached positions")
    if (new_k is None) != (new_v is None):
        raise ValueError("decode_attention: new_k and new_v come together")
    if new_k is not None:
        if new_k.shape != (r, hkv, d) or new_v.shape != (r, hkv, d) or new_k.dtype != cache_k.dtype \
                or new_v.dtype != cache_k.dtype:
            raise ValueError(f"decode_attention: new_k/new_v must be [{r}, {hkv}, {d}] in {cache_k.dtype}, got "
                             f"{tuple(new_k.shape)} {new_k.dtype} / {tuple(new_v.shape)} {new_v.dtype}")
        new_k, new_v = new_k.contiguous(), new_v.contiguous()
    qf = q.to(torch.float32).contiguous()
    slots, limit = slots.contiguous(), limit.contiguous()
    out = torch.empty(r, hkv, g, d, dtype=torch.float32)
    fn = lib.tandem_decode_attention_f32 if cache_k.dtype == torch.float32 else lib.tandem_decode_attention_bf16
    ks, vs = cache_k.stride(), cache_v.stride()
    rc = fn(qf.data_ptr(), cache_k.data_ptr(), cache_v.data_ptr(), ks[0], ks[1], ks[2], vs[0], vs[1], vs[2],
            slots.data_ptr(), limit.data_ptr(), None if new_k is None else new_k.data_ptr(),
            None if new_v is None else new_v.data_ptr(), out.data_ptr(), r, hkv, g, d, float(scale), max_len)
    if rc != 0:
        raise RuntimeError(f"native decode_attention failed (code {rc}: -1 shape over the limits, -2 no memory)")
    return out if cache_k.dtype == torch.float32 else out.to(cache_k.dtype)


def sample(lib: ctypes.CDLL, logits: torch.Tensor, temperatures: torch.Tensor,
           uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row ``r`` of float32 ``logits [R, V]`` (CPU, last dimension contiguous) sampled at temperature
    ``temperatures[r]`` (float32; <= 0: greedy) with the uniform number ``uniforms[r]`` (float64) by inverse
    CDF over the full vocabulary -> ``tokens [R]`` int64 and their log-probs ``[R]`` float32 under
    ``log_softmax(logits / T)`` (csrc/sample.c; `tandem.engines.inference.torch.sampling` without
    top-k / top-p)."""
    if logits.dtype != torch.float32 or logits.dim() != 2 or logits.device.type != "cpu" or logits.stride(-1) != 1:
        raise ValueError(f"sample: logits must be a CPU float32 [R, V] tensor with a contiguous last dimension, "
                         f"got {logits.dtype} {tuple(logits.shape)} on {logits.device}")
    r, v = logits.shape
    if temperatures.dtype != torch.float32 or uniforms.dtype != torch.float64 or len(temperatures) != r or len(uniforms) != r:
        raise ValueError(f"sample: temperatures (float32) and uniforms (float64) need {r} entries each")
    temperatures, uniforms = temperatures.contiguous(), uniforms.contiguous()
    tokens, log_probs = torch.empty(r, dtype=torch.int64), torch.empty(r, dtype=torch.float32)
    rc = lib.tandem_sample_f32(logits.data_ptr(), r, v, logits.stride(0), temperatures.data_ptr(),
                               uniforms.data_ptr(), tokens.data_ptr(), log_probs.data_ptr())
    if rc != 0:
        raise RuntimeError(f"native sample failed (code {rc}: -2 no memory)")
    return tokens, log_probs


def pack_b64(lib: ctypes.CDLL, source: torch.Tensor, dst_ptr: int, dst_nbytes: int,
             plain: torch.Tensor | None = None, block: int = 64) -> None:
    """Write ``source [N, K]`` (CPU, contiguous, float32 or bfloat16 with even K; N a multiple of 64) in
    oneDNN's packed inner-product layout (csrc/pack.c: 32-bit unit ``(n, k)`` to ``[n / 64][k][n % 64]``) into
    the ``dst_nbytes`` bytes at ``dst_ptr``, and, with ``plain``, copy it into ``plain`` (same shape and
    dtype, contiguous) in the same pass. ``block=16``: oneDNN's other float32 layout, ``[n / 16][k][n % 16]``
    (N a multiple of 16). The memory at ``dst_ptr`` must be writable and not in use: the caller owns it
    (tandem/ops/linear.py passes a packed tensor's own buffer)."""
    if (source.device.type != "cpu" or source.dim() != 2 or not source.is_contiguous()
            or source.dtype not in (torch.float32, torch.bfloat16)):
        raise ValueError(f"pack_b64: source must be a contiguous CPU float32/bfloat16 [N, K] tensor, got "
                         f"{source.dtype} {tuple(source.shape)} on {source.device}")
    if block not in (16, 64) or (block == 16 and source.dtype != torch.float32):
        raise ValueError(f"pack_b64: block={block} for {source.dtype}: 64, or 16 for float32")
    n, k = source.shape
    units = k if source.dtype == torch.float32 else k // 2  # 32-bit units per row
    if n % block or n == 0 or units == 0 or (source.dtype == torch.bfloat16 and k % 2):
        raise ValueError(f"pack_b64: shape {(n, k)} in {source.dtype}: N must be a positive multiple of {block}"
                         + (" and K even" if source.dtype == torch.bfloat16 else ""))
    if dst_nbytes != source.numel() * source.element_size():
        raise ValueError(f"pack_b64: destination holds {dst_nbytes} bytes, the weight {source.numel() * source.element_size()}")
    if plain is not None and (plain.shape != source.shape or plain.dtype != source.dtype or not plain.is_contiguous()
                              or plain.device.type != "cpu"):
        raise ValueError(f"pack_b64: plain must be a contiguous CPU {source.dtype} tensor of shape {(n, k)}")
    if plain is not None and plain.data_ptr() == source.data_ptr():
        plain = None  # already holds the source
    fn = lib.tandem_pack_b64 if block == 64 else lib.tandem_pack_b16
    rc = fn(source.data_ptr(), None if plain is None else plain.data_ptr(), dst_ptr, n, units)
    if rc != 0:
        raise RuntimeError(f"native pack failed (code {rc})")


def skinny(lib: ctypes.CDLL, x: torch.Tensor, packed_ptr: int, n: int, bias: torch.Tensor | None,
           block: int = 64) -> torch.Tensor:
    """``x [M, K] . W[n, K]^T (+ bias)`` -> ``[M, n]`` in ``x``'s dtype (float32, or bfloat16 with AVX-512 BF16),
    with W in oneDNN's packed layout of that dtype at ``packed_ptr`` (csrc/skinny.c): blocks of ``block`` outputs,
    64 (n a multiple of 64) or, float32 only, 16 (``[n/16][K][16]``, n a multiple of 16). ``x`` contiguous and
    ``bias [n]`` of its dtype or None: the caller checks (tandem/ops/linear.py, a decode step's hot path).
    ValueError where the kernel cannot take them (the message says why)."""
    m, k = x.shape
    if block == 16:
        if x.dtype != torch.float32:
            raise ValueError(f"skinny: blocks of 16 outputs are float32 only, not {x.dtype}")
        fn = lib.tandem_skinny16_f32
    elif block == 64:
        fn = lib.tandem_skinny_f32 if x.dtype == torch.float32 else lib.tandem_skinny_bf16
    else:
        raise ValueError(f"skinny: block={block} must be 64 or 16")
    y = torch.empty(m, n, dtype=x.dtype)
    rc = fn(x.data_ptr(), m, k, packed_ptr, n, None if bias is None else bias.data_ptr(), y.data_ptr())
    if rc:
        raise ValueError(f"skinny: {(n, k)} {x.dtype}: " + ("built without AVX-512 BF16" if rc == -2 else
                                                          f"N must be a multiple of {block} (and K even for bfloat16)"))
    return y


_POINTWISE_DTYPES = (torch.float32, torch.bfloat16)
# (these wrappers run ~150 times a decode step: their checks are kept to a few attribute reads)


def rms_norm(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """HF's RMSNorm of ``x [..., D]`` with ``weight [D]`` in one pass (csrc/pointwise.c), or None where the
    kernel does not apply (another dtype or device, a non-contiguous operand): the caller's torch path."""
    dtype = x.dtype
    if (dtype not in _POINTWISE_DTYPES or weight.dtype != dtype or not x.is_cpu or not weight.is_cpu
            or x.dim() == 0 or weight.shape != x.shape[-1:] or not x.is_contiguous() or not weight.is_contiguous()):
        return None
    out = torch.empty_like(x)
    d = x.shape[-1]
    lib.tandem_rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // d if d else 0, d,
                        eps, dtype is torch.bfloat16)
    return out


def swiglu(lib: ctypes.CDLL, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """``silu(a) * b`` in one pass, or None where the kernel does not apply."""
    dtype = a.dtype
    if (dtype not in _POINTWISE_DTYPES or b.dtype != dtype or not a.is_cpu or not b.is_cpu or a.shape != b.shape
            or not a.is_contiguous() or not b.is_contiguous()):
        return None
    out = torch.empty_like(a)
    lib.tandem_swiglu(a.data_ptr(), b.data_ptr(), out.data_ptr(), a.numel(), dtype is torch.bfloat16)
    return out


def rotary(lib: ctypes.CDLL, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """``x * cos + rotate_half(x) * sin`` for ``x [N, H, D]`` (heads contiguous in a row, rows at any stride)
    and ``cos, sin`` of ``N x D`` elements (``[N, D]`` or ``[N, 1, D]``, contiguous) -> contiguous ``[N, H, D]``;
    None where the kernel does not apply."""
    dtype = x.dtype
    if dtype not in _POINTWISE_DTYPES or x.dim() != 3 or not x.is_cpu or cos.dtype != dtype or sin.dtype != dtype:
        return None
    n, h, d = x.shape
    if (d % 2 or x.stride(2) != 1 or x.stride(1) != d or cos.shape[0] != n or cos.numel() != n * d
            or sin.numel() != n * d or not cos.is_contiguous() or not sin.is_contiguous() or not cos.is_cpu
            or not sin.is_cpu):
        return None
    out = torch.empty((n, h, d), dtype=dtype)
    lib.tandem_rotary(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), n, h, d,
                      dtype is torch.bfloat16)
    return out


def _same(dtype: torch.dtype, *tensors: torch.Tensor) -> bool:
    return all(t.dtype == dtype and t.is_cpu for t in tensors)


def swiglu_backward(lib: ctypes.CDLL, a: torch.Tensor, b: torch.Tensor,
                    dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The gradients ``(da, db)`` of ``silu(a) * b`` for ``dy`` in one pass (float32 arithmetic, rounded once to
    the dtype, as lean_ops' torch formula), or None where the kernel does not apply."""
    dtype = a.dtype
    if (dtype not in _POINTWISE_DTYPES or not _same(dtype, a, b, dy) or a.shape != b.shape or dy.shape != a.shape
            or not a.is_contiguous() or not b.is_contiguous()):
        return None
    dy = dy.contiguous()
    da, db = torch.empty_like(a), torch.empty_like(b)
    lib.tandem_swiglu_backward(a.data_ptr(), b.data_ptr(), dy.data_ptr(), da.data_ptr(), db.data_ptr(), a.numel(),
                               dtype is torch.bfloat16)
    return da, db


def rms_norm_backward(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, rsqrt: torch.Tensor,
                      dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """RMSNorm's gradients ``(dx, dw)`` for ``dy`` given the forward's input ``x [..., D]``, ``weight [D]`` and
    float32 ``rsqrt`` (one per row), or None where the kernel does not apply. ``dw`` sums per block of rows, then
    the blocks in order: the same bits at any thread count."""
    dtype = x.dtype
    d = x.shape[-1] if x.dim() else 0
    if (dtype not in _POINTWISE_DTYPES or not _same(dtype, x, weight, dy) or d == 0 or weight.shape != (d,)
            or dy.shape != x.shape or not x.is_contiguous() or not weight.is_contiguous()
            or rsqrt.dtype != torch.float32 or not rsqrt.is_cpu or not rsqrt.is_contiguous()
            or rsqrt.numel() != x.numel() // d):
        return None
    rows = x.numel() // d
    dy = dy.contiguous()
    block = lib.tandem_rms_block()
    partial = torch.empty((rows + block - 1) // block, d, dtype=torch.float32)
    dx = torch.empty_like(x)
    lib.tandem_rms_norm_backward(x.data_ptr(), weight.data_ptr(), rsqrt.data_ptr(), dy.data_ptr(), dx.data_ptr(),
                                 partial.data_ptr(), rows, d, dtype is torch.bfloat16)
    return dx, partial.sum(0).to(weight.dtype)


def rotary_backward(lib: ctypes.CDLL, dy: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor) -> torch.Tensor | None:
    """The gradient of ``x * cos + rotate_half(x) * sin`` for ``dy [N, H, D]`` with ``cos, sin`` of ``N x D``
    elements (``[N, D]`` or ``[N, 1, D]``), or None where the kernel does not apply."""
    dtype = dy.dtype
    if dtype not in _POINTWISE_DTYPES or dy.dim() != 3 or not _same(dtype, dy, cos, sin):
        return None
    n, h, d = dy.shape
    if (d % 2 or cos.numel() != n * d or sin.numel() != n * d or cos.shape[0] != n or not cos.is_contiguous()
            or not sin.is_contiguous()):
        return None
    dy = dy.contiguous()
    out = torch.empty((n, h, d), dtype=dtype)
    lib.tandem_rotary_backward(dy.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), n, h, d,
                               dtype is torch.bfloat16)
    return out


_E4M3_LUT: torch.Tensor | None = None  # the 256 e4m3fn values as float32, from torch's own conversion


def dequant_fp8_block(lib: ctypes.CDLL, codes: torch.Tensor, scale: torch.Tensor, bm: int, bk: int) -> torch.Tensor:
    """``codes [R, K]`` (uint8 e4m3fn bytes, CPU) times their block's float32 ``scale [ceil(R / bm), ceil(K / bk)]``
    -> float32 ``[R, K]`` (csrc/dequant.c): each element one float32 multiply of its decoded code, as
    `tandem.kernels.reference.dequant` computes it, so the same bits."""
    global _E4M3_LUT
    if codes.dtype != torch.uint8 or codes.dim() != 2 or not codes.is_cpu or scale.dtype != torch.float32:
        raise ValueError(f"dequant_fp8_block: uint8 [R, K] CPU codes and float32 scales, got {codes.dtype} "
                         f"{tuple(codes.shape)} on {codes.device} and {scale.dtype}")
    r, k = codes.shape
    grid = (-(-r // bm), -(-k // bk))
    if tuple(scale.shape) != grid or not scale.is_cpu:
        raise ValueError(f"dequant_fp8_block: scale of shape {tuple(scale.shape)}; codes {(r, k)} in blocks "
                         f"{(bm, bk)} need {grid} on the CPU")
    if _E4M3_LUT is None:
        _E4M3_LUT = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
    codes, scale = codes.contiguous(), scale.contiguous()
    out = torch.empty(r, k, dtype=torch.float32)
    lib.tandem_dequant_fp8_block(codes.data_ptr(), _E4M3_LUT.data_ptr(), scale.data_ptr(), out.data_ptr(), r, k, bm, bk)
    return out
