"""butter-affine's GPU kernels, each written once in butter's dialect (Metal and CUDA),
each paired with a pure-mx reference in ``KERNEL_CHECKS``.

- ``quantize.quantize_kv``: new K/V rows -> codes, scales, biases (appends).
- ``dequantize.dequantize_kv``: the live slots as floats (prefill attention).
- ``decode.decode_attention``: fused single-token attention reading the codes
  (split-K, with the scheme-independent pieces in ``butter_core.kernels.split_k``);
  ``decode.paged_decode_attention``, the same for many sequences at once over the shared
  pages of batched storage (``butter_core.batched``), each read in place through its table.
- ``decode_mma.decode_attention``: the same on tensor cores, for 4-, 6- and 8-bit codes
  with float16/bfloat16 queries (fragment bookkeeping in ``butter_core.kernels.mma``).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from butter_core.plugin_api import KernelCheck, unstack

from butter_affine import codec
from butter_affine.kernels import decode, decode_mma, dequantize, quantize
from butter_affine.packing import BUFFERS, STACKS


def _quantized_rows(quantize_kv):
    """``quantize_kv`` as one float32 array (codes unpacked, then scales, then biases)
    so a check can compare two packings element by element."""

    def run(keys, values, bits, group_size):
        packed = unstack(quantize_kv(keys, values, bits=bits, group_size=group_size), STACKS)
        parts = [codec.unpack(packed[name], bits) if name.endswith("codes") else packed[name] for name in BUFFERS]
        return mx.concatenate([part.astype(mx.float32).reshape(-1) for part in parts])

    return run


def _both(dequantize_kv):
    """``dequantize_kv``'s keys and values as one array."""

    def run(**inputs):
        keys, values = dequantize_kv(**inputs)
        return mx.concatenate([keys.reshape(-1), values.reshape(-1)])

    return run


def make_quantize_inputs(
    seed: int, *, bits: int = 4, group_size: int = 32, batch: int = 1, heads: int = 2,
    tokens: int = 1, head_dim: int = 128, dtype: mx.Dtype = mx.bfloat16,
) -> dict:
    """Random K/V rows whose groups span magnitudes 1e-3..1e3 and include one-signed groups."""
    rng = np.random.default_rng(seed)
    shape = (batch, heads, tokens, head_dim)
    magnitude = 10.0 ** rng.uniform(-3, 3, (*shape[:-1], head_dim // group_size, 1))
    keys, values = (
        (rng.standard_normal((*shape[:-1], head_dim // group_size, group_size)) * magnitude).reshape(shape)
        for _ in range(2)
    )
    values = np.abs(values) * np.where(rng.random(shape[:-1] + (1,)) < 0.5, -1, 1)
    return {"keys": mx.array(keys).astype(dtype), "values": mx.array(values).astype(dtype),
            "bits": bits, "group_size": group_size}


def make_dequantize_inputs(
    seed: int, *, bits: int = 4, group_size: int = 32, batch: int = 1, heads: int = 2,
    allocated: int = 64, length: int = 50, head_dim: int = 128, dtype: mx.Dtype = mx.bfloat16,
) -> dict:
    """Whole packed buffers of ``allocated`` slots, ``length`` of them live."""
    rng = np.random.default_rng(seed)
    shape = (batch, heads, allocated, head_dim)
    keys, values = (mx.array(rng.standard_normal(shape, dtype=np.float32)).astype(dtype) for _ in range(2))
    packed = codec.quantize(keys, bits, group_size) + codec.quantize(values, bits, group_size)
    return {**dict(zip(BUFFERS, packed)), "length": length, "bits": bits, "dtype": dtype}


# The first cases of each check use the shapes bench/gpu_affine.py times (bf16, head_dim
# 128, 4 query heads per KV head; 4/6/8 bits at their default groups), so the bench
# compiles no kernel twice; the rest cover the other dtypes, head dims, groups and GQA
# ratios.
_MMA_RTOL = {mx.bfloat16: 5e-3, mx.float16: 1.5e-3}
"""The tensor-core kernels' tolerance. Float16 queries, probabilities and (8-bit) keys and values
put the kernel's own float32 result ~3e-4 from the reference; with the output rounded to bf16 the
check measured <= 1.3e-3 (fp16 <= 4.9e-4) under a CPU emulation of the CUDA build. Tighter than
the defaults, so a bf16-arithmetic slip (~1e-2) fails."""

_PAGED_CASES = (
    {},
    {"lengths": (5,), "batch": 1, "bits": 8, "group_size": 64, "dtype": mx.float16, "head_dim": 64},
    {"lengths": (700, 64, 1, 333), "batch": 4, "page_size": 64, "q_heads": 16, "kv_heads": 4, "bits": 6,
     "dtype": mx.float32},
    {"lengths": (1200, 17), "batch": 2, "page_size": 32, "q_heads": 32, "kv_heads": 8},
)
"""Sequences of different lengths in scattered pages: the cases of both paged decode kernels' checks
(the tensor-core one takes float16 for float32, which it does not serve)."""

KERNEL_CHECKS: tuple[KernelCheck, ...] = (
    KernelCheck(
        name="quantize_kv",
        kernel=_quantized_rows(quantize.quantize_kv),
        reference=_quantized_rows(quantize.quantize_kv_reference),
        make_inputs=make_quantize_inputs,
        cases=(
            {},
            {"bits": 8, "group_size": 64, "tokens": 3},
            {"bits": 6, "group_size": 32, "tokens": 17, "heads": 4},
            {"bits": 6, "group_size": 64, "head_dim": 64, "batch": 2},
            {"bits": 4, "group_size": 128, "tokens": 40, "dtype": mx.float16},
            {"bits": 8, "group_size": 32, "head_dim": 64, "tokens": 5, "dtype": mx.float32},
        ),
        # Same float32 steps in the same order: codes, scales and biases match exactly.
        rtol={mx.float32: 0.0},
    ),
    KernelCheck(
        name="dequantize_kv",
        kernel=_both(dequantize.dequantize_kv),
        reference=_both(dequantize.dequantize_kv_reference),
        make_inputs=make_dequantize_inputs,
        cases=(
            {},
            {"bits": 8, "group_size": 64, "length": 64},
            {"bits": 6, "group_size": 32, "length": 1, "heads": 3},
            {"bits": 6, "group_size": 64, "head_dim": 64, "batch": 2, "allocated": 300, "length": 257,
             "dtype": mx.float16},
            {"bits": 4, "group_size": 128, "dtype": mx.float32, "allocated": 256, "length": 200},
        ),
    ),
    KernelCheck(
        name="decode_attention",
        kernel=decode.decode_attention,
        reference=decode.decode_attention_reference,
        make_inputs=decode.make_inputs,
        cases=(
            {"length": 1, "allocated": 16},
            {"bits": 8, "group_size": 64, "length": 200},
            {"bits": 6, "group_size": 32, "length": 257, "allocated": 300},
            {"bits": 4, "group_size": 64, "length": 1000, "allocated": 1024, "q_heads": 8, "kv_heads": 8,
             "head_dim": 64},
            {"bits": 4, "length": 5000, "allocated": 6000, "q_heads": 32, "kv_heads": 8, "batch": 2},
            {"bits": 8, "group_size": 128, "length": 777, "allocated": 800, "q_heads": 24, "kv_heads": 2,
             "dtype": mx.float16},
            {"bits": 6, "group_size": 64, "length": 3000, "allocated": 4096, "q_heads": 28, "kv_heads": 4,
             "dtype": mx.float32},
            {"bits": 8, "group_size": 32, "length": 300, "allocated": 512, "head_dim": 256, "q_heads": 4,
             "kv_heads": 1, "dtype": mx.float32},
        ),
    ),
    KernelCheck(
        name="paged_decode_attention",
        kernel=decode.paged_decode_attention,
        reference=decode.paged_decode_attention_reference,
        make_inputs=decode.make_paged_inputs,
        cases=_PAGED_CASES,
    ),
    KernelCheck(
        name="decode_attention_mma",
        kernel=decode_mma.decode_attention,
        reference=decode.decode_attention_reference,
        make_inputs=decode.make_inputs,
        # Every bits x head_dim x dtype the kernel takes; GQA groups 1, 2, 4, 7, 8, 12 (two
        # column tiles), 16; lengths that are no multiple of a warp's 16 keys; forced splits
        # (``splits``) that leave some splits without a key.
        cases=(
            {"length": 1, "allocated": 16},
            {"q_heads": 32, "kv_heads": 8, "length": 200, "allocated": 256},
            {"bits": 8, "group_size": 64, "q_heads": 32, "kv_heads": 8, "length": 257, "allocated": 300},
            {"bits": 6, "group_size": 32, "q_heads": 32, "kv_heads": 8, "length": 257, "allocated": 300},
            {"bits": 6, "group_size": 64, "head_dim": 256, "q_heads": 12, "kv_heads": 1, "length": 1000,
             "allocated": 1024, "dtype": mx.float16},
            {"bits": 6, "group_size": 128, "q_heads": 8, "kv_heads": 2, "length": 3001, "allocated": 3072,
             "splits": 1, "dtype": mx.float16},
            {"bits": 6, "group_size": 32, "head_dim": 256, "q_heads": 2, "kv_heads": 2, "length": 40,
             "allocated": 64, "splits": 5},
            {"group_size": 64, "q_heads": 8, "kv_heads": 8, "length": 1000, "allocated": 1024, "dtype": mx.float16},
            {"bits": 8, "group_size": 128, "q_heads": 24, "kv_heads": 2, "length": 777, "allocated": 800,
             "dtype": mx.float16},
            {"head_dim": 64, "q_heads": 16, "kv_heads": 1, "length": 300, "allocated": 512, "batch": 2},
            {"bits": 8, "head_dim": 64, "q_heads": 7, "kv_heads": 1, "length": 129, "allocated": 256,
             "dtype": mx.float16},
            {"group_size": 128, "head_dim": 256, "q_heads": 4, "kv_heads": 1, "length": 300, "allocated": 512},
            {"bits": 8, "head_dim": 256, "q_heads": 16, "kv_heads": 2, "length": 100, "allocated": 128,
             "dtype": mx.float16},
            {"length": 10, "allocated": 64, "splits": 8},
            {"q_heads": 8, "kv_heads": 2, "length": 1601, "allocated": 1664, "splits": 1},  # LONG_KEY_BLOCKS
            {"bits": 8, "group_size": 64, "head_dim": 64, "q_heads": 4, "kv_heads": 4, "length": 33,
             "allocated": 48, "splits": 6},
            {"head_dim": 64, "q_heads": 32, "kv_heads": 8, "length": 5000, "allocated": 6000, "batch": 2,
             "dtype": mx.float16},
            {"bits": 8, "group_size": 64, "head_dim": 256, "q_heads": 8, "kv_heads": 2, "length": 1000,
             "allocated": 1024},
            {"head_dim": 256, "q_heads": 2, "kv_heads": 2, "length": 64, "allocated": 64, "dtype": mx.float16,
             "splits": 3},
            {"bits": 8, "group_size": 32, "head_dim": 64, "q_heads": 40, "kv_heads": 1, "length": 150,
             "allocated": 160},  # a GQA group of 40: four threadgroups of 10 heads (two column tiles)
            # One or two splits over thousands of keys: each warp loops ~50 times, so the
            # running max grows (rescaling) as it does at long contexts.
            {"q_heads": 8, "kv_heads": 2, "length": 3001, "allocated": 3072, "splits": 1},
            {"bits": 8, "group_size": 32, "q_heads": 16, "kv_heads": 2, "length": 4000, "allocated": 4096,
             "splits": 2, "dtype": mx.float16},
        ),
        rtol=_MMA_RTOL,
        tensor_cores=True,
        kernel_options=("splits",),
    ),
    KernelCheck(
        # The tensor-core kernel reading a cache's stacks in place (what a traced decode step
        # runs): every code width, both head sizes and query dtypes, batches, forced splits.
        name="stacked_decode_attention_mma",
        kernel=decode_mma.decode_attention_stacked,
        reference=decode.decode_attention_reference,
        make_inputs=decode.make_inputs,
        cases=(
            {"q_heads": 32, "kv_heads": 8, "length": 200, "allocated": 256},
            {"bits": 8, "group_size": 64, "head_dim": 64, "q_heads": 4, "kv_heads": 4, "length": 33,
             "allocated": 48, "splits": 6, "dtype": mx.float16},
            {"bits": 6, "group_size": 32, "q_heads": 32, "kv_heads": 8, "length": 257, "allocated": 300},
            {"head_dim": 64, "q_heads": 16, "kv_heads": 1, "length": 300, "allocated": 512, "batch": 2},
            {"bits": 8, "head_dim": 256, "q_heads": 16, "kv_heads": 2, "length": 100, "allocated": 128,
             "dtype": mx.float16, "batch": 3},
        ),
        rtol=_MMA_RTOL,
        tensor_cores=True,
        kernel_options=("splits",),
    ),
    KernelCheck(
        name="paged_decode_attention_mma",
        kernel=decode_mma.paged_decode_attention,
        reference=decode.paged_decode_attention_reference,
        make_inputs=decode.make_paged_inputs,
        # Sequences of different lengths, pages scattered through the storage; pages of 16 (a
        # warp's key block spans one page), 32 and 64; lengths that end inside a page and a key
        # block; forced splits over a long sequence and beside one of a single key.
        cases=(
            *(case | {"dtype": mx.float16} if case.get("dtype", mx.bfloat16) == mx.float32 else case for case in _PAGED_CASES),
            {"lengths": (2000, 1), "batch": 2, "page_size": 16, "q_heads": 8, "kv_heads": 2, "splits": 2},
            # pages of 64 and splits that start inside one: steps in one page read as one run, others not
            {"lengths": (520, 130), "batch": 2, "page_size": 64, "q_heads": 8, "kv_heads": 2, "splits": 3},
            {"lengths": (90, 300, 47), "batch": 3, "page_size": 16, "bits": 8, "group_size": 32, "head_dim": 256,
             "q_heads": 4, "kv_heads": 2},
        ),
        rtol=_MMA_RTOL,
        tensor_cores=True,
        kernel_options=("splits",),
    ),
)
"""Every butter-affine kernel with its reference, for the conformance suite and the GPU bench."""
