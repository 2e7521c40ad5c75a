"""Low-precision kernels shared by trainers, weight sync and engines: the same bits on both sides.

Formats: FP8 e4m3 block quantization (weights ``128 x 128``, activations ``1 x 128``; fp32 or UE8M0
scales, the SGLang/vLLM ``weight_scale_inv`` layout), MXFP8 (OCP MX v1.0, 32-element blocks, E8M0
scales), INT4 symmetric/asymmetric per-group fake quantization with a straight-through estimator,
and INT4 packing (two codes per byte).

Every op has a pure-torch reference (`reference`) and a Triton kernel (`triton_kernels`) that
produce identical bits; ``backend="auto"`` runs Triton on CUDA tensors and the reference elsewhere.
Triton is imported only when a kernel runs, so this package imports without triton or a GPU.

Integration: `apply_qat` (trainer: fake-quantized linears), `quantize_state_dict` /
`iter_quantized` (sync: quantize on send), `dequantize_state_dict` and `DequantizeOnLoad` (engine:
dequantize on load). See docs/kernels.md.
"""

from tandem.kernels.config import QuantConfig
from tandem.kernels.fp8 import (
    dequantize_fp8_activation,
    dequantize_fp8_block,
    fake_quantize_fp8_activation,
    fake_quantize_fp8_block,
    quantize_fp8_activation,
    quantize_fp8_block,
)
from tandem.kernels.int4 import dequantize_int4, fake_quantize_int4, pack_int4, quantize_int4, unpack_int4
from tandem.kernels.load import DequantizeOnLoad
from tandem.kernels.mxfp8 import dequantize_mxfp8, fake_quantize_mxfp8, quantize_mxfp8
from tandem.kernels.qat import (
    QATLinear,
    apply_qat,
    fake_quantize,
    fake_quantize_weight,
    qat_targets,
    quantize_linear_inputs,
    remove_qat,
)
from tandem.kernels.state_dict import dequantize_state_dict, iter_quantized, quantize_state_dict

__all__ = [
    "DequantizeOnLoad",
    "QATLinear",
    "QuantConfig",
    "apply_qat",
    "dequantize_fp8_activation",
    "dequantize_fp8_block",
    "dequantize_int4",
    "dequantize_mxfp8",
    "dequantize_state_dict",
    "fake_quantize",
    "fake_quantize_fp8_activation",
    "fake_quantize_fp8_block",
    "fake_quantize_int4",
    "fake_quantize_mxfp8",
    "fake_quantize_weight",
    "iter_quantized",
    "pack_int4",
    "qat_targets",
    "quantize_fp8_activation",
    "quantize_fp8_block",
    "quantize_int4",
    "quantize_linear_inputs",
    "quantize_mxfp8",
    "quantize_state_dict",
    "remove_qat",
    "unpack_int4",
]
