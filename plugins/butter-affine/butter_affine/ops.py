"""Which implementation of each affine operation a cache uses here, chosen once per cache.

Three operations: quantize new rows, dequantize the live slots (multi-token attention),
and single-token decode attention. Per backend, from measurement:

| operation | CPU | CUDA | Metal (not measured: no Apple GPU here) |
|---|---|---|---|
| quantize | float32: ``mx.quantize`` (identical to the reference, 9x faster than it); else the reference, compiled | ``quantize_kv`` kernel | ``quantize_kv`` kernel |
| dequantize | reference (``codec.dequantize``) | ``dequantize_kv`` kernel | ``dequantize_kv`` kernel |
| decode | float32: ``mx.quantized_matmul`` on the codes; else dequantize + SDPA | 4/8-bit, float16/bfloat16: tensor-core ``decode_mma`` kernel; else fused ``decode_attention`` kernel | dequantize + SDPA (the seed's path) |

CPU: float32 is what butter runs there (``butter_core.loading.weights``); there
``mx.quantize`` and ``mx.quantized_matmul`` compute exactly what the reference does, and
the quantized_matmul path is the fastest of the three, but ~3x raw SDPA's time
(``bench/cpu_decode_paths.py``, 30 default-model layers at 1k context, quiet machine,
2026-11-30: 25-34 ms against 8.3-8.6 for raw; reference dequantize + SDPA 27-48,
``mx.dequantize`` + SDPA 30-59). An earlier measurement (45.7 against 42.4 ms at 2k)
did not hold up. This is most of affine's CPU decode tax (0.70x raw's tok/s in
``butter bench``); MLX's CPU quantized kernels, not butter's code, are the cost. In bf16, ``mx.quantized_matmul``
computes in bf16 (3e-2 relative error against the float32 reference), so other dtypes
dequantize to float32 and use SDPA.

CUDA (H200, bf16, 32/8 heads, D=128, amortised; docs/benchmarks.md): the fused kernel
is the fastest accurate path at every context measured: at 128k, affine4 157.6 µs
against 315.4 for ``mx.quantized_matmul`` and 2648 for dequantize + SDPA. At 4k
``mx.quantized_matmul`` is faster (31 against 45 µs) but computes in bf16, and on 8-bit
codes it crashed MLX 0.32.4 (illegal memory access), so it is not used.

The tensor-core kernel (``kernels.decode_mma``) takes 4- and 8-bit codes with float16 or
bfloat16 queries and scales, and head_dim 64/128/256; 6-bit codes and float32 keep the
float32 ``decode`` kernel. On the H200 at 128k it takes 0.4x the float32 kernel's time
(affine4 63.0-71.3 against 157-162 µs; 0.47-0.55x raw SDPA's; ``bench/gpu_affine.py``), and
0.82-0.97x raw's at 4k and 32k.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import attrs
import mlx.core as mx

from butter_core.kernels import default_device_is_gpu, gpu_backend

from butter_affine import codec
from butter_affine.kernels import decode, decode_mma, dequantize, quantize
from butter_affine.packing import BUFFERS, PackedFormat

Buffers = dict[str, mx.array]
Quantize = Callable[[mx.array, mx.array], Buffers]
Dequantize = Callable[[Buffers, int], tuple[mx.array, mx.array]]
Decode = Callable[[mx.array, Buffers, int, float], mx.array]


@attrs.frozen
class AffineOps:
    """The functions one cache calls: ``quantize(keys, values)`` -> rows by buffer name;
    ``dequantize(buffers, length)`` -> live keys and values; ``decode(queries, buffers,
    length, scale)`` -> single-token attention, or None to dequantize and use SDPA.
    ``buffers`` are the cache's whole arrays; no function needs a slice of them."""

    name: str
    quantize: Quantize
    dequantize: Dequantize
    decode: Decode | None


def select_ops(fmt: PackedFormat) -> AffineOps:
    """The implementations for ``fmt`` on the device MLX runs on now."""
    backend = gpu_backend() if default_device_is_gpu() else None
    if backend is None:
        return _cpu_ops(fmt)
    kernel_quantize = partial(quantize.quantize_kv, bits=fmt.bits, group_size=fmt.group_size)
    ops = AffineOps(
        name=f"{backend} kernels",
        quantize=kernel_quantize,
        dequantize=lambda buffers, length: dequantize.dequantize_kv(
            *(buffers[name] for name in BUFFERS), length=length, bits=fmt.bits, dtype=fmt.dtype
        ),
        decode=None,
    )
    if backend == "cuda" and decode_mma.supports(fmt, fmt.dtype):
        ops = attrs.evolve(ops, name="cuda kernels, tensor-core fused decode", decode=_tensor_core_decode)
    elif backend == "cuda" and decode.supports(fmt, fmt.dtype):
        ops = attrs.evolve(ops, name="cuda kernels, fused decode", decode=_fused_decode)
    return ops


def _fused_decode(queries: mx.array, buffers: Buffers, length: int, scale: float) -> mx.array:
    return decode.decode_attention(queries, *(buffers[name] for name in BUFFERS), length=length, scale=scale)


def _tensor_core_decode(queries: mx.array, buffers: Buffers, length: int, scale: float) -> mx.array:
    if queries.dtype not in decode_mma.SUPPORTED_DTYPES:  # e.g. float32 queries: keep float32 arithmetic
        return _fused_decode(queries, buffers, length, scale)
    return decode_mma.decode_attention(queries, *(buffers[name] for name in BUFFERS), length=length, scale=scale)


def _cpu_ops(fmt: PackedFormat) -> AffineOps:
    bits, group_size = fmt.bits, fmt.group_size
    if fmt.dtype == mx.float32:
        def quantize_rows(keys, values):
            packed = mx.quantize(keys, group_size=group_size, bits=bits) + mx.quantize(
                values, group_size=group_size, bits=bits
            )
            return dict(zip(BUFFERS, packed))
    else:
        quantize_rows = mx.compile(partial(quantize.quantize_kv_reference, bits=bits, group_size=group_size))

    def dequantize_live(buffers, length):
        live = [buffers[name][:, :, :length] for name in BUFFERS]
        return codec.dequantize(*live[:3], bits, fmt.dtype), codec.dequantize(*live[3:], bits, fmt.dtype)

    return AffineOps(
        name="cpu, pure mx",
        quantize=quantize_rows,
        dequantize=dequantize_live,
        decode=partial(quantized_matmul_decode, bits=bits, group_size=group_size) if fmt.dtype == mx.float32 else None,
    )


def quantized_matmul_decode(
    queries: mx.array, buffers: Buffers, length: int, scale: float, *, bits: int, group_size: int
) -> mx.array:
    """Single-token attention through ``mx.quantized_matmul`` on the codes (mlx-lm's path):
    scores = q Kᵀ, softmax, out = p V, each matmul dequantizing as it reads."""
    batch, q_heads, _, dims = queries.shape
    kv_heads = buffers["key_codes"].shape[1]
    live = {name: array[:, :, :length] for name, array in buffers.items()}
    q = (queries * scale).reshape(batch, kv_heads, q_heads // kv_heads, dims)
    scores = mx.quantized_matmul(
        q, live["key_codes"], live["key_scales"], live["key_biases"], transpose=True, group_size=group_size, bits=bits
    )
    weights = mx.softmax(scores, axis=-1, precise=True)
    out = mx.quantized_matmul(
        weights, live["value_codes"], live["value_scales"], live["value_biases"],
        transpose=False, group_size=group_size, bits=bits,
    )
    return out.reshape(batch, q_heads, 1, dims)
