"""Which implementation of each affine operation a cache uses here, chosen once per cache.

Three operations: quantize new rows, dequantize the live slots (multi-token attention),
and single-token decode attention. Per backend, from measurement (docs/benchmarks.md,
"plugins/butter-affine/butter_affine/ops.py"):

| operation | CPU | CUDA | Metal (not measured: no Apple GPU here) |
|---|---|---|---|
| quantize | float32: ``mx.quantize`` (identical to the reference, and faster); else the reference, compiled | ``quantize_kv`` kernel, traced once per row shape (``traced_quantize``) | ``quantize_kv`` kernel |
| dequantize | reference (``codec.dequantize``), compiled | ``dequantize_kv`` kernel | ``dequantize_kv`` kernel |
| decode | float32: 8-bit codes with one group per row: the keys' codes cast to float32 and a matmul, scales and biases applied to the products, the values through ``mx.quantized_matmul`` (``one_group_decode``); other float32 formats: dequantized keys (as planes) and matmuls for the scores, ``mx.quantized_matmul`` for the values (``float32_decode``); either traced once per buffer shape; else dequantize + SDPA | 4/6/8-bit (6-bit: head_dim 128/256), float16/bfloat16: tensor-core ``decode_mma`` kernel; else fused ``decode_attention`` kernel; either traced once per buffer shape (``kernel_decode``) | dequantize + SDPA (the seed's path) |

CPU: float32 is what butter runs there (``butter_core.loading.weights``); there
``mx.quantize`` and ``mx.quantized_matmul`` compute exactly what the reference does.
MLX's CPU ``quantized_matmul`` is quick for the values' product (``transpose=False``)
but slow for the scores' (``transpose=True``), so the scores come from the keys
dequantized by a compiled ``codec.dequantize_planes`` (8-bit codes through a byte view,
4- and 6-bit codes as planes of every second or fourth coordinate) and BLAS matmuls.
MLX's CPU quantized kernels and elementwise unpacking, not butter's code, are most of
affine's CPU decode tax. Where a row is one group and its codes are bytes (affine8 at
head_dim 64, butter's default model), the keys need no dequantizing: the scores are
``s (q · c) + b Σq`` from codes only cast to float32, and the values go through
``mx.quantized_matmul`` (``one_group_decode``). The same algebra with several groups per
row (per-group products through a block-diagonal query) was slower, for affine4 and for
affine8 with two groups per row, so other formats keep the planes. Both CPU decode paths
take their products with the keys as rows and their softmax from
``butter_core.cpu_attention.softmax_for`` (base 2 from 512 keys), as raw's CPU decode
does. In bf16, ``mx.quantized_matmul`` computes in bf16 (3e-2 relative error against the
float32 reference), so other dtypes dequantize to float32 and use SDPA.

CUDA: the fused kernels are the fastest accurate path at every context measured.
``mx.quantized_matmul`` is faster at 4k but computes in bf16, and on 8-bit codes in the
form the CPU path uses (query heads as matrix rows) it crashed MLX 0.32.4 (illegal memory
access), so it is not used.

The tensor-core kernel (``kernels.decode_mma``) takes 4-, 6- and 8-bit codes with float16
or bfloat16 queries and scales, and head_dim 64/128/256 (6-bit: 128/256); float32 and
6-bit codes at head_dim 64 keep the slower float32 ``decode`` kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache, partial, reduce

import attrs
import mlx.core as mx

from butter_core.plugin_api import (
    compile_by_shape,
    default_device_is_gpu,
    gpu_backend,
    grouped_queries,
    kernel_params,
    slot_update,
    softmax_for,
    unstack,
)

from butter_affine import codec
from butter_affine.kernels import decode, decode_mma, dequantize, quantize
from butter_affine.packing import BUFFERS, STACKS, PackedFormat, stack_quantized_pair

Buffers = dict[str, mx.array]
"""Arrays by buffer name (``packing.BUFFERS``) or by stack name (``packing.STACKS``)."""
Quantize = Callable[[mx.array, mx.array], Buffers]
Dequantize = Callable[[Buffers, int], tuple[mx.array, mx.array]]
Decode = Callable[[mx.array, Buffers, int, float], mx.array]
DecodeStep = Callable[..., tuple[mx.array, mx.array, mx.array]]
"""``(queries, keys, values, codes, scales_biases, start, live, scale) -> (out, codes, scales_biases)``:
``kernel_decode_step``."""


@attrs.frozen
class AffineOps:
    """The functions one cache calls: ``quantize(keys, values)`` -> rows by stack
    (``packing.STACKS``);
    ``dequantize(buffers, length)`` -> live keys and values, from the buffers by name;
    ``decode(queries, stacks, length, scale)`` -> single-token attention, from the two
    stacks (``SlotBuffers.read(stacked=True)``), or None to dequantize and use SDPA;
    ``decode_step``, where there is one, the append and ``decode`` of one token as one function of
    arrays, run traced (``AffineCache.step_call``). Each gets the cache's whole arrays; no function
    needs a slice of them."""

    name: str
    quantize: Quantize
    dequantize: Dequantize
    decode: Decode | None
    decode_step: DecodeStep | None = None


def select_ops(fmt: PackedFormat) -> AffineOps:
    """The implementations for ``fmt`` on the device MLX runs on now."""
    backend = gpu_backend() if default_device_is_gpu() else None
    if backend is None:
        return _cpu_ops(fmt)
    kernel_quantize = (traced_quantize(fmt.bits, fmt.group_size) if backend == "cuda"
                       else partial(quantize.quantize_kv, bits=fmt.bits, group_size=fmt.group_size))
    ops = AffineOps(
        name=f"{backend} kernels",
        quantize=kernel_quantize,
        dequantize=lambda buffers, length: dequantize.dequantize_kv(
            *(buffers[name] for name in BUFFERS), length=length, bits=fmt.bits, dtype=fmt.dtype
        ),
        decode=None,
    )
    kernel = decode_kernel(fmt, fmt.dtype)
    if backend == "cuda" and kernel is not None:
        tensor_cores = kernel is decode_mma
        ops = attrs.evolve(ops, name=f"cuda kernels, {'tensor-core ' if tensor_cores else ''}fused decode",
                           decode=shared_kernel_decode(tensor_cores),
                           decode_step=kernel_decode_step(fmt, tensor_cores))
    return ops


def decode_kernel(fmt: PackedFormat, queries_dtype: mx.Dtype):
    """The fused decode kernel module (``kernels.decode_mma`` or ``kernels.decode``) that
    serves ``fmt`` with ``queries_dtype`` on the GPU MLX runs on now, or None (no GPU, or
    neither serves it): the tensor-core kernel on CUDA where it serves the format, else the
    SIMT one. One sequence's decode (``select_ops``, CUDA only) and batched storage's paged
    decode (every GPU) both choose by it."""
    backend = gpu_backend() if default_device_is_gpu() else None
    if backend == "cuda" and decode_mma.supports(fmt, queries_dtype) and decode_mma.available():
        return decode_mma
    if backend is not None and decode.supports(fmt, queries_dtype):
        return decode
    return None


@cache
def traced_quantize(bits: int, group_size: int) -> Quantize:
    """``quantize.quantize_kv`` traced once per row shape (``compile_by_shape``) and shared by
    every layer's cache: on CUDA a decode step's append replays one trace per layer instead
    of building the kernel call anew, as ``kernel_decode`` does for attention."""
    return compile_by_shape(partial(quantize.quantize_kv, bits=bits, group_size=group_size))


def kernel_decode(*, tensor_cores: bool) -> Decode:
    """Single-token attention by a fused decode kernel (``decode_mma`` where
    ``tensor_cores`` and the queries are float16/bfloat16, reading the stacks in place; else
    ``decode``, through views of the stacks' members), from a cache's stacks, traced by ``mx.compile`` once per buffer shape (``compile_by_shape``) and
    replayed every step: the live length and the scale reach the kernel as device arrays
    (``decode_attention_live``), so the call's graph does not change between steps, only
    when the buffers grow. Replaying costs far less host time than building the call
    anew, and a decode step on the GPU is host-bound (measurements: docs/benchmarks.md,
    "plugins/butter-affine/butter_affine/ops.py")."""

    traced = compile_by_shape(partial(_decode_graph, tensor_cores=tensor_cores))

    def attend(queries: mx.array, stacks: Buffers, length: int, scale: float) -> mx.array:
        allocated = stacks["codes"].shape[-2]
        if not 0 < length <= allocated:
            raise ValueError(f"length {length} outside 1..{allocated}")
        return traced(queries, stacks["codes"], stacks["scales_biases"], kernel_params((length,), mx.int32),
                      kernel_params((scale,), mx.float32))

    attend.traces = traced.traces
    return attend


def _decode_graph(queries, codes, scales_biases, live, scale, *, tensor_cores: bool) -> mx.array:
    """Single-token attention over a cache's two stacks by the fused decode kernel, as traced."""
    if tensor_cores and queries.dtype in decode_mma.SUPPORTED_DTYPES:
        return decode_mma.decode_attention_stacks(queries, codes, scales_biases, live=live, scale=scale)
    buffers = unstack({"codes": codes, "scales_biases": scales_biases}, STACKS)
    return decode.decode_attention_live(queries, *(buffers[name] for name in BUFFERS), live=live, scale=scale)


@cache
def shared_kernel_decode(tensor_cores: bool) -> Decode:
    """``kernel_decode``, made once: every layer's cache shares it, and so its traces."""
    return kernel_decode(tensor_cores=tensor_cores)


@cache
def kernel_decode_step(fmt: PackedFormat, tensor_cores: bool) -> DecodeStep:
    """A decode step's append and attention as one function of arrays, which a cache's caller runs
    traced (``AffineCache.step_call``; one function for every layer's cache, so their traces are
    shared): ``quantize_kv`` of the token, its rows written into the two stacks at slot ``start``
    (``slot_update``) (a device array, as are the live length ``live`` and ``scale``), then the
    fused decode kernel over the written stacks, whose outputs replace the cache's. One replay a
    layer where ``traced_quantize``, two slice assignments and ``kernel_decode`` take four calls
    (measurements: docs/benchmarks.md, "Issue 32, ninth session")."""

    def decode_step(queries, keys, values, codes, scales_biases, start, live, scale):
        rows = quantize.quantize_kv(keys.astype(fmt.dtype), values.astype(fmt.dtype), bits=fmt.bits,
                                    group_size=fmt.group_size)
        codes = slot_update(codes, rows["codes"], start, axis=3)
        scales_biases = slot_update(scales_biases, rows["scales_biases"], start, axis=3)
        out = _decode_graph(queries, codes, scales_biases, live, scale, tensor_cores=tensor_cores)
        return out.astype(queries.dtype), codes, scales_biases

    return decode_step


@cache
def _cpu_ops(fmt: PackedFormat) -> AffineOps:
    """The CPU functions for ``fmt``, made once per format: every layer's cache shares them,
    so each ``mx.compile``d function is traced once, not once per layer."""
    bits, group_size = fmt.bits, fmt.group_size
    if fmt.dtype == mx.float32:
        def quantize_rows(keys, values):
            # One mx.quantize over keys and values stacked: a faster append than one
            # mx.quantize each (docs/benchmarks.md, "plugins/butter-affine/butter_affine/ops.py").
            return stack_quantized_pair(*mx.quantize(mx.stack([keys, values]), group_size=group_size, bits=bits))
    else:
        quantize_rows = compile_by_shape(partial(quantize.quantize_kv_reference, bits=bits, group_size=group_size))

    dequantize_rows = compile_by_shape(partial(codec.dequantize, bits=bits, dtype=fmt.dtype))

    def dequantize_live(buffers, length):
        live = [buffers[name][:, :, :length] for name in BUFFERS]
        return dequantize_rows(*live[:3]), dequantize_rows(*live[3:])

    return AffineOps(
        name="cpu, pure mx",
        quantize=quantize_rows,
        dequantize=dequantize_live,
        decode=_cpu_decode(fmt),
    )


def _cpu_decode(fmt: PackedFormat) -> Decode | None:
    """The CPU's single-token attention for ``fmt`` (None: dequantize and use SDPA)."""
    if fmt.dtype != mx.float32:
        return None
    if fmt.bits == 8 and fmt.groups == 1:
        return one_group_decode
    return partial(float32_decode, bits=fmt.bits, group_size=fmt.group_size)


def one_group_decode(queries: mx.array, stacks: Buffers, length: int, scale: float) -> mx.array:
    """Single-token attention over a cache's stacks of float32 8-bit codes with one scale
    and bias per row, on the CPU, from the codes themselves: with row ``i``'s key code
    bytes ``c_i`` (only cast to float32), ``q · k_i = s_i (q · c_i) + b_i Σq``, a matmul on
    the cast codes and a few products the size of the scores; the values' product is
    ``mx.quantized_matmul`` (``transpose=False``, MLX's fast direction on the CPU), which
    reads the value codes without a cast. Products and softmax in
    ``butter_core.cpu_attention``'s form (keys as rows, ``softmax_for``). (The values were
    cast too until 2026-12-02, ``Σ_i w_i v_i = (w s) · c + w · b``; ``quantized_matmul``
    is faster.)

    Every product runs over all allocated slots, the weights of those past ``length`` set
    to 0 (their codes, scales and biases are finite: zeros or an earlier row's): the live
    slots of a buffer that has room to grow are a strided slice, which MLX's CPU casts
    and elementwise ops take on a slower general path. (The planes path,
    ``float32_decode``, gained nothing this way.)

    The whole step is one ``mx.compile``d function per buffer shape, the live length a
    mask from an array (``kernel_params``), so MLX fuses the elementwise ops around the
    two products and builds one call instead of about fifteen, which pays where MLX's
    per-op cost is high (a small CPU). Measurements of all three: docs/benchmarks.md,
    "plugins/butter-affine/butter_affine/ops.py"."""
    # One group per row: a row's 8-bit codes are its group (uint32 words of 4 codes).
    return _traced_decode(queries, stacks, length, scale, scores=_one_group_scores, bits=8,
                          group_size=stacks["codes"].shape[-1] * 4)


def _one_group_scores(q: mx.array, buffers: Buffers, bits: int) -> mx.array:
    """``one_group_decode``'s scores: the key codes' bytes cast to float32, then
    ``q · k_i = s_i (q · c_i) + b_i Σq``."""
    keys = mx.view(buffers["key_codes"], mx.uint8).astype(mx.float32)
    return (keys @ q.swapaxes(-1, -2)) * buffers["key_scales"] + buffers["key_biases"] * q.sum(axis=-1)[..., None, :]


def float32_decode(queries: mx.array, stacks: Buffers, length: int, scale: float, *, bits: int,
                   group_size: int) -> mx.array:
    """Single-token attention over a cache's stacks of float32 codes on the CPU: scores
    against the keys dequantized as planes (``codec.dequantize_planes``: every second or
    fourth coordinate per plane), through float32 matmuls, then ``mx.quantized_matmul``
    for the values (mlx-lm uses it for both products).

    MLX's CPU ``quantized_matmul`` is fast for ``p V`` (``transpose=False``) but not for
    ``q Kᵀ`` (``transpose=True``); measurements: docs/benchmarks.md,
    "plugins/butter-affine/butter_affine/ops.py". Like
    ``one_group_decode``, it runs over every allocated slot as one traced call per
    buffer shape, the live length a mask from an array."""
    return _traced_decode(queries, stacks, length, scale, scores=_planes_scores, bits=bits, group_size=group_size)


def _planes_scores(q: mx.array, buffers: Buffers, bits: int) -> mx.array:
    """``float32_decode``'s scores: one float32 product per plane of the dequantized keys."""
    planes = codec.dequantize_planes(buffers["key_codes"], buffers["key_scales"], buffers["key_biases"], bits,
                                     mx.float32)
    n = len(planes)
    return reduce(mx.add, [plane @ q[..., k::n].swapaxes(-1, -2) for k, plane in enumerate(planes)])


Scores = Callable[[mx.array, Buffers, int], mx.array]
"""A CPU decode step's scores ``[..., slots, heads]`` from the grouped queries, the
buffers by name and the code bits."""


def _traced_decode(queries: mx.array, stacks: Buffers, length: int, scale: float, *, scores: Scores, bits: int,
                   group_size: int) -> mx.array:
    """The CPU decode step shared by ``one_group_decode`` and ``float32_decode``: ``scores``,
    the softmax over the live slots, ``mx.quantized_matmul`` for the values, as one call
    traced per buffer shape, the live length passed as an array (``kernel_params``)."""
    factor, softmax = softmax_for(length)
    live = kernel_params((length,), mx.int32)
    step = _traced_step(scale * factor, softmax, scores, bits, group_size)
    return step(queries, stacks["codes"], stacks["scales_biases"], live)


@cache
def _traced_step(scale: float, softmax: Callable[[mx.array], mx.array], scores: Scores, bits: int,
                 group_size: int) -> Callable[..., mx.array]:
    """``_step`` for one query scale, softmax, scoring and format, traced once per buffer
    shape (``compile_by_shape``): the trace holds until the buffers grow, and MLX fuses
    its elementwise ops."""
    return compile_by_shape(partial(_step, scale=scale, softmax=softmax, scores=scores, bits=bits,
                                    group_size=group_size))


def _step(queries: mx.array, codes: mx.array, scales_biases: mx.array, live: mx.array, *, scale: float,
          softmax: Callable[[mx.array], mx.array], scores: Scores, bits: int, group_size: int) -> mx.array:
    buffers = unstack({"codes": codes, "scales_biases": scales_biases}, STACKS)
    q = grouped_queries(queries, codes.shape[2], scale)
    out = mx.quantized_matmul(
        _live_weights(softmax, scores(q, buffers, bits), live), buffers["value_codes"], buffers["value_scales"],
        buffers["value_biases"], transpose=False, group_size=group_size, bits=bits,
    )
    return out.reshape(queries.shape)


def _live_weights(softmax: Callable[[mx.array], mx.array], scores: mx.array, live: mx.array) -> mx.array:
    """Attention weights ``[..., heads, slots]`` from scores ``[..., slots, heads]`` over
    every allocated slot: ``softmax`` over slots ``[0, live)`` (``live`` a one-element
    int32 array, so a trace serves every length), 0 for the rest (whose rows are finite:
    zeros, or an earlier row's)."""
    valid = mx.arange(scores.shape[-2], dtype=mx.int32)[:, None] < live
    return mx.where(valid.swapaxes(-1, -2), softmax(mx.where(valid, scores, -mx.inf).swapaxes(-1, -2)), 0.0)
