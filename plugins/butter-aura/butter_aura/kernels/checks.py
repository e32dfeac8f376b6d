"""``KERNEL_CHECKS``: each AURA kernel with its reference and the inputs both are checked on.

Inputs are random and adversarial where it is cheap to be: slots past ``length`` hold
random code words; full-precision rows hold the original vectors (so reading a slot's
codes where its row should be read, or the reverse, shows as a coding-sized error);
the recent ring holds stale entries (slots past ``length``) and empty ones.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import mlx.core as mx
import numpy as np

from butter_core.plugin_api import KernelCheck, scattered_pages

from butter_aura import reference
from butter_aura.codec import SCALE_DTYPE, Codec
from butter_aura.kernels import attention, dequantize, encode, paged
from butter_aura.layout import FullPrecisionBudget, full_precision_dtype
from butter_aura.rotation import Rotation
from butter_aura.stored import StoredLayer


def _keys(seed: int, n: int) -> list[mx.array]:
    return list(mx.random.split(mx.random.key(seed), n))


def make_stored(
    seed: int,
    *,
    batch: int = 1,
    q_heads: int = 8,
    kv_heads: int = 2,
    head_dim: int = 128,
    allocated: int = 256,
    length: int = 200,
    dtype: mx.Dtype = mx.bfloat16,
    key_bits: int = 4,
    value_bits: int = 2,
    group: int | None = None,
    sinks: int = 4,
    recent: int = 32,
    recent_end: int | None = None,
    ring_start: int | None = None,
    encoded: bool = True,
    rotation_seed: int | None = None,
) -> dict:
    """Queries and a ``StoredLayer`` of ``length`` live slots in buffers of ``allocated``.

    ``encoded``: slots hold the codes of random vectors (else random code words and
    scales, cheaper at long contexts). The recent ring holds the ``recent`` slots below
    ``recent_end`` (default ``length``; less puts the ring inside the live range), except
    one entry made stale (a slot past ``length``) and one empty. With ``ring_start`` the
    slots are a window's ring (``length == allocated``, reused from ``ring_start`` on,
    ``FullPrecisionBudget.for_capacity``): each ring row holds the slot of the newest
    position it serves, the newest being at ``recent_end - 1``, as after the window
    wrapped. ``rotation_seed`` (default ``seed``) seeds the rotation: layers that share one can be
    stored together (``paged.make_paged_inputs``).
    """
    k_q, k_k, k_v, k_w1, k_w2, k_s = _keys(seed, 6)
    group = group or head_dim
    rotation = Rotation(seed if rotation_seed is None else rotation_seed, kv_heads, head_dim)
    key_codec, value_codec = Codec(key_bits, group, head_dim), Codec(value_bits, group, head_dim)
    shape = (batch, kv_heads, allocated, head_dim)
    keys = mx.random.normal(shape, key=k_k).astype(dtype)
    values = mx.random.normal(shape, key=k_v).astype(dtype)
    if encoded:
        key_codes, key_scales, value_codes, value_scales = reference.encode(keys, values, rotation, key_codec, value_codec)
        live = mx.arange(allocated)[:, None] < length
        garbage = mx.random.randint(0, 2**31, (batch, kv_heads, allocated, key_codec.words), key=k_w1).astype(mx.uint32)
        key_codes = mx.where(live, key_codes, garbage)
        garbage = mx.random.randint(0, 2**31, (batch, kv_heads, allocated, value_codec.words), key=k_w2).astype(mx.uint32)
        value_codes = mx.where(live, value_codes, garbage)
    else:
        key_codes = mx.random.randint(0, 2**31, (*shape[:3], key_codec.words), key=k_w1).astype(mx.uint32)
        value_codes = mx.random.randint(0, 2**31, (*shape[:3], value_codec.words), key=k_w2).astype(mx.uint32)
        scale_shape = (*shape[:3], key_codec.groups)
        key_scales = (mx.random.uniform(0.5, 1.5, scale_shape, key=k_s) * head_dim**-0.5 * 3).astype(SCALE_DTYPE)
        value_scales = (mx.random.uniform(0.5, 1.5, (*shape[:3], value_codec.groups), key=k_s) * 0.1).astype(SCALE_DTYPE)
    recent_end = length if recent_end is None else recent_end
    if ring_start is None:
        budget = FullPrecisionBudget(sinks, recent, sinks, allocated, allocated)
        newest_first = range(recent_end - 1, max(sinks, recent_end - recent) - 1, -1)
    else:
        budget = FullPrecisionBudget.for_capacity(allocated, ring_start, sinks, recent)
        region = list(range(budget.base, allocated))  # the order the window reuses them in
        newest_first = [region[(region.index(recent_end) - k) % len(region)] for k in range(1, len(region) + 1)]
    recent_slots = [-1] * budget.ring
    for slot in newest_first:
        index = budget.ring_index(slot)
        if index is not None and recent_slots[index] < 0:
            recent_slots[index] = slot
    if recent >= 2:
        recent_slots[0] = length + 3 if recent_slots[0] >= 0 else recent_slots[0]  # stale: past length
        recent_slots[1] = -1
    fp_dtype = full_precision_dtype(dtype)
    rows = [min(s, allocated - 1) for s in range(sinks)] + [s if s >= 0 else 0 for s in recent_slots]
    rows = [min(r, allocated - 1) for r in rows]
    stored = StoredLayer(
        key_codes=key_codes,
        key_scales=key_scales,
        value_codes=value_codes,
        value_scales=value_scales,
        fp_keys=keys[:, :, rows].astype(fp_dtype),
        fp_values=values[:, :, rows].astype(fp_dtype),
        recent_slots=mx.array(recent_slots, dtype=mx.int32),
        length=length,
        budget=budget,
        key_codec=key_codec,
        value_codec=value_codec,
        rotation=rotation,
    )
    queries = mx.random.normal((batch, q_heads, 1, head_dim), key=k_q).astype(dtype)
    return {"queries": queries, "stored": stored, "scale": head_dim**-0.5}


def make_decode_step_inputs(seed: int, **sizes) -> dict:
    """``make_stored``'s layer and a decode step's token: random keys and values bound for the ring row
    of the newest slot (``recent_end - 1``, default ``length - 1``), which the ring says it holds (as
    the step's ring bookkeeping left it), and that row (``row``). The row still holds another vector,
    so a merge that read it instead of the token would show."""
    inputs = make_stored(seed, **sizes)
    stored = inputs["stored"]
    slot = sizes.get("recent_end", stored.length) - 1
    index = stored.budget.ring_index(slot)
    if index is None:
        raise ValueError(f"slot {slot} has no ring row in {stored.budget}: a decode step's token needs one")
    recent = stored.recent_slots.tolist()
    recent[index] = slot
    stored = attrs.evolve(stored, recent_slots=mx.array(recent, dtype=mx.int32))
    batch, heads, _, dims = stored.fp_keys.shape
    k_k, k_v = _keys(seed + 1, 2)
    dtype = inputs["queries"].dtype
    keys = mx.random.normal((batch, heads, 1, dims), key=k_k).astype(dtype)
    values = mx.random.normal((batch, heads, 1, dims), key=k_v).astype(dtype)
    return {**inputs, "stored": stored, "keys": keys, "values": values, "row": stored.budget.sinks + index}


def decode_step_kernel(queries, keys, values, row, stored, scale) -> mx.array:
    """``attention.decode_step_attention``'s output (its written rows: ``written_rows``)."""
    return attention.decode_step_attention(queries, keys, values, row, stored, scale)[0]


def written_rows(keys, values, row, stored) -> tuple[mx.array, mx.array]:
    """The full-precision rows with the token written into row ``row`` as ``AuraCache`` writes a ring
    row (``astype``, slice assignment): what ``decode_step_attention`` must return beside its output."""
    fp_keys, fp_values = mx.array(stored.fp_keys), mx.array(stored.fp_values)
    fp_keys[:, :, row : row + 1] = keys.astype(fp_keys.dtype)
    fp_values[:, :, row : row + 1] = values.astype(fp_values.dtype)
    return fp_keys, fp_values


def decode_step_reference(queries, keys, values, row, stored, scale) -> mx.array:
    """``reference.decode_attention`` after the token's write (``written_rows``)."""
    fp_keys, fp_values = written_rows(keys, values, row, stored)
    return reference.decode_attention(queries, attrs.evolve(stored, fp_keys=fp_keys, fp_values=fp_values), scale)


def make_encode_inputs(
    seed: int, *, batch=1, kv_heads=2, tokens=33, head_dim=128, dtype=mx.bfloat16, key_bits=4, value_bits=2, group=None
) -> dict:
    k_k, k_v = _keys(seed, 2)
    shape = (batch, kv_heads, tokens, head_dim)
    group = group or head_dim
    return {
        "keys": (mx.random.normal(shape, key=k_k) * 3).astype(dtype),
        "values": mx.random.normal(shape, key=k_v).astype(dtype),
        "rotation": Rotation(seed, kv_heads, head_dim),
        "key_codec": Codec(key_bits, group, head_dim),
        "value_codec": Codec(value_bits, group, head_dim),
    }


def _decoded(coded, key_codec: Codec, value_codec: Codec) -> mx.array:
    key_codes, key_scales, value_codes, value_scales = coded
    return mx.concatenate([key_codec.decode(key_codes, key_scales), value_codec.decode(value_codes, value_scales)], axis=-1)


def encode_kernel_decoded(keys, values, rotation, key_codec, value_codec) -> mx.array:
    """The kernel's codes, decoded by the reference decoder (rotated keys, then values)."""
    return _decoded(encode.encode(keys, values, rotation, key_codec, value_codec), key_codec, value_codec)


def encode_reference_decoded(keys, values, rotation, key_codec, value_codec) -> mx.array:
    return _decoded(reference.encode(keys, values, rotation, key_codec, value_codec), key_codec, value_codec)


def make_dequantize_inputs(seed: int, **sizes) -> dict:
    inputs = make_stored(seed, **sizes)
    return {"stored": inputs["stored"], "dtype": sizes.get("dtype", mx.bfloat16)}


def dequantize_kernel_joined(stored, dtype) -> mx.array:
    return mx.concatenate(dequantize.dequantize(stored, dtype), axis=-1)


def dequantize_reference_joined(stored, dtype) -> mx.array:
    return mx.concatenate(reference.dequantize(stored, dtype), axis=-1)


def mma_decode_attention(queries, stored, scale, splits: int | None = None) -> mx.array:
    """``decode_attention`` through the tensor-core partials kernel (``attention_mma``)."""
    return attention.decode_attention(queries, stored, scale, method="mma", splits=splits)


def simt_paged_decode_attention(**inputs) -> mx.array:
    """``paged.paged_decode_attention`` through the SIMT partials kernel (which a CUDA GPU with tensor
    cores takes only where the tensor-core kernel does not serve)."""
    return paged.paged_decode_attention(**inputs, method="simt")


def mma_paged_decode_attention(*, splits: int | None = None, **inputs) -> mx.array:
    """``paged.paged_decode_attention`` through the tensor-core partials kernel (``attention_mma``)."""
    return paged.paged_decode_attention(**inputs, method="mma", splits=splits)


def make_paged_inputs(seed: int, *, lengths: Sequence[int] = (1, 40, 200), page_size: int = 16, **sizes) -> dict:
    """Random ``paged.paged_decode_attention`` arguments: one ``make_stored`` layer per sequence (its
    codes, full-precision rows and ring with a stale and an empty entry), its slots scattered over
    pages of storage whose other slots hold random code words, and its full-precision rows put in a
    shuffled sequence row of a pool with one row more than sequences. ``sizes`` go to ``make_stored``
    (not ``ring_start``: batched windows are checked end to end, ``tests/test_batched.py``)."""
    rng = np.random.default_rng(seed)
    layers = [make_stored(seed + b, length=n, allocated=n, rotation_seed=seed, **sizes) for b, n in enumerate(lengths)]
    table, live, total = scattered_pages(rng, lengths, page_size)
    first = layers[0]["stored"]
    heads, rows = first.key_codes.shape[1], first.fp_keys.shape[2]
    storage = {}
    for name in ("key_codes", "key_scales", "value_codes", "value_scales"):
        like = getattr(first, name)
        array = np.array(mx.random.randint(0, 2**31, (1, heads, total, like.shape[-1]), key=mx.random.key(seed)))
        array = (array % 1024 / 1024 + 0.5).astype(np.float32) if name.endswith("scales") else array.astype(np.uint32)
        for slots, layer in zip(live, layers):
            array[0][:, slots] = np.array(getattr(layer["stored"], name).astype(mx.float32 if name.endswith("scales")
                                                                                else mx.uint32))[0]  # fmt: skip
        storage[name] = mx.array(array).astype(like.dtype)
    sequence_rows = rng.permutation(len(lengths) + 1)[: len(lengths)]
    fp = {}
    for name in ("fp_keys", "fp_values"):
        pool = mx.zeros(((len(lengths) + 1) * rows, heads, first.fp_keys.shape[3]), getattr(first, name).dtype)
        for row, layer in zip(sequence_rows, layers):
            pool[int(row) * rows : (int(row) + 1) * rows] = getattr(layer["stored"], name)[0].transpose(1, 0, 2)
        fp[name] = pool
    capacity = max(lengths)  # every sequence's slots lie below the budget's tail, as in batched storage
    budget = FullPrecisionBudget(first.budget.sinks, first.budget.recent, first.budget.sinks, capacity, capacity)
    stored = paged.PagedStored(
        **storage, **fp, recent=[layer["stored"].recent_slots.tolist() for layer in layers],
        sequence_rows=mx.array(sequence_rows.astype(np.int32)), table=mx.array(table), lengths=list(lengths),
        page_size=page_size, budget=budget, key_codec=first.key_codec, value_codec=first.value_codec,
        rotation=first.rotation,
    )  # fmt: skip
    queries = mx.concatenate([layer["queries"] for layer in layers], axis=0)
    return {"queries": queries, "paged": stored, "scale": layers[0]["scale"]}


ENCODE_RTOL = {mx.float32: 2e-3}
"""Codes are chosen by comparisons, so the kernel and the reference agree exactly except
where a value lies within a rounding of a decision boundary or a least-squares scale
rounds to the other float16 neighbour (summation order): rare, and small."""

ATTENTION_RTOL = {mx.float32: 2e-5, mx.float16: 2e-3, mx.bfloat16: 1e-2}

KERNEL_CHECKS: tuple[KernelCheck, ...] = (
    KernelCheck(
        name="encode",
        kernel=encode_kernel_decoded,
        reference=encode_reference_decoded,
        make_inputs=make_encode_inputs,
        cases=(
            {},
            {"tokens": 1, "dtype": mx.float16},
            {"head_dim": 64, "dtype": mx.float32, "key_bits": 8, "value_bits": 4},
            {"key_bits": 3, "value_bits": 3, "tokens": 7, "batch": 2},
            {"key_bits": 8, "value_bits": 8, "group": 32, "kv_heads": 4},
            {"key_bits": 4, "value_bits": 2, "group": 16, "head_dim": 64, "dtype": mx.float16},
            {"key_bits": 2, "value_bits": 4, "group": 64, "tokens": 300},
        ),
        rtol=ENCODE_RTOL,
    ),
    KernelCheck(
        name="decode_attention",
        kernel=attention.decode_attention,
        reference=reference.decode_attention,
        make_inputs=make_stored,
        cases=(
            {"length": 1, "allocated": 16},
            {"length": 30, "allocated": 64, "dtype": mx.float16},
            {"length": 200, "allocated": 256},
            {"length": 257, "allocated": 300, "dtype": mx.float32, "head_dim": 64, "key_bits": 8, "value_bits": 4},
            {"length": 1000, "allocated": 1024, "q_heads": 8, "kv_heads": 8, "head_dim": 64, "key_bits": 3, "value_bits": 2},
            {"length": 5000, "allocated": 6000, "q_heads": 32, "kv_heads": 8, "batch": 2, "encoded": False},
            {"length": 777, "allocated": 800, "q_heads": 24, "kv_heads": 2, "dtype": mx.float16, "key_bits": 8,
             "value_bits": 8, "group": 32},
            {"length": 3000, "allocated": 4096, "q_heads": 28, "kv_heads": 4, "dtype": mx.float32, "group": 16,
             "sinks": 0, "recent": 0},
            {"length": 600, "allocated": 700, "q_heads": 6, "kv_heads": 3, "head_dim": 64, "sinks": 2, "recent": 5},
            # Window rings (ring rows of their own past the last whole period, rows for the
            # newest positions across the wrap): 296 ring slots, then 44, then keep 0.
            {"length": 300, "allocated": 300, "ring_start": 4, "recent_end": 37},
            {"length": 48, "allocated": 48, "ring_start": 4, "recent_end": 10, "dtype": mx.float16},
            {"length": 120, "allocated": 120, "ring_start": 0, "recent_end": 119, "head_dim": 64, "key_bits": 8},
            {"length": 200, "allocated": 200, "ring_start": 10, "recent_end": 30, "head_dim": 64},
        ),
        rtol=ATTENTION_RTOL,
    ),
    KernelCheck(
        # A decode step's token written by the merge kernel into the row it reads (its tensor-core
        # partials on CUDA where they serve, else the SIMT ones), windows' rings included.
        name="decode_step",
        kernel=decode_step_kernel,
        reference=decode_step_reference,
        make_inputs=make_decode_step_inputs,
        cases=(
            {"length": 30, "allocated": 64, "dtype": mx.float16},
            {"length": 200, "allocated": 256},
            {"length": 257, "allocated": 300, "dtype": mx.float32, "head_dim": 64, "key_bits": 8, "value_bits": 4},
            {"length": 5000, "allocated": 6000, "q_heads": 32, "kv_heads": 8, "batch": 2, "encoded": False},
            {"length": 600, "allocated": 700, "q_heads": 6, "kv_heads": 3, "head_dim": 64, "sinks": 2, "recent": 5},
            {"length": 48, "allocated": 48, "ring_start": 4, "recent_end": 10, "dtype": mx.float16},
        ),
        rtol=ATTENTION_RTOL,
    ),
    KernelCheck(
        name="paged_decode_attention",
        kernel=simt_paged_decode_attention,
        reference=paged.paged_decode_attention_reference,
        make_inputs=make_paged_inputs,
        cases=(
            {},
            {"lengths": (5,), "dtype": mx.float16, "head_dim": 64},
            {"lengths": (300, 1, 64, 129), "page_size": 64, "q_heads": 16, "kv_heads": 4, "dtype": mx.float32},
            {"lengths": (1200, 37), "page_size": 32, "q_heads": 32, "kv_heads": 8, "key_bits": 8, "value_bits": 4},
        ),
        rtol=ATTENTION_RTOL,
    ),
    KernelCheck(
        # Every configuration the tensor-core kernel serves (aura4v2, aura4v4, aura8v4,
        # aura8v8 x head_dim 128/64 x float16/bfloat16), each
        # with one awkward feature: lengths that are not a multiple of the 16-key step,
        # allocated == length (the last step clamps at the buffer's end), splits with no
        # key and splits shorter than a step, a recent ring inside the live range, no
        # full-precision rows, only a sink, GQA groups of 1, 2, 3, 6, 7 and 8 heads per
        # threadgroup, random code words at long lengths.
        name="decode_attention_mma",
        kernel=mma_decode_attention,
        reference=reference.decode_attention,
        make_inputs=make_stored,
        cases=(
            {"length": 200, "allocated": 256},
            {"length": 1000, "allocated": 1000, "dtype": mx.float16, "q_heads": 32, "kv_heads": 8,
             "recent_end": 517},
            {"length": 9, "allocated": 16, "head_dim": 64, "splits": 6, "sinks": 1, "recent": 2},
            {"length": 300, "allocated": 320, "head_dim": 64, "dtype": mx.float16, "q_heads": 16, "kv_heads": 2},
            {"length": 777, "allocated": 800, "key_bits": 4, "value_bits": 4, "batch": 2, "q_heads": 24,
             "kv_heads": 2},
            {"length": 130, "allocated": 136, "key_bits": 4, "value_bits": 4, "dtype": mx.float16, "splits": 3,
             "sinks": 0, "recent": 0},
            {"length": 500, "allocated": 512, "key_bits": 4, "value_bits": 4, "head_dim": 64, "q_heads": 8,
             "kv_heads": 8},
            {"length": 64, "allocated": 64, "key_bits": 4, "value_bits": 4, "head_dim": 64, "dtype": mx.float16,
             "q_heads": 6, "kv_heads": 3},
            {"length": 2000, "allocated": 2048, "key_bits": 8, "value_bits": 4, "q_heads": 32, "kv_heads": 8,
             "encoded": False},
            {"length": 50, "allocated": 64, "key_bits": 8, "value_bits": 4, "dtype": mx.float16},
            {"length": 257, "allocated": 300, "key_bits": 8, "value_bits": 4, "head_dim": 64, "q_heads": 12,
             "kv_heads": 4},
            {"length": 1, "allocated": 16, "key_bits": 8, "value_bits": 4, "head_dim": 64, "dtype": mx.float16},
            {"length": 600, "allocated": 640, "key_bits": 8, "value_bits": 8, "splits": 40, "recent_end": 300},
            {"length": 333, "allocated": 400, "key_bits": 8, "value_bits": 8, "dtype": mx.float16},
            {"length": 100, "allocated": 128, "key_bits": 8, "value_bits": 8, "head_dim": 64, "batch": 2,
             "q_heads": 14, "kv_heads": 2},
            {"length": 3000, "allocated": 3000, "key_bits": 8, "value_bits": 8, "head_dim": 64, "dtype": mx.float16,
             "q_heads": 8, "kv_heads": 1, "encoded": False},
            {"length": 300, "allocated": 300, "ring_start": 4, "recent_end": 37},
            {"length": 48, "allocated": 48, "ring_start": 4, "recent_end": 10, "head_dim": 64, "dtype": mx.float16},
        ),
        rtol=ATTENTION_RTOL,
        backends=frozenset({"cuda"}),  # 64 KB of dynamic shared memory, which Metal's custom kernels lack
        tensor_cores=True,
        kernel_options=("splits",),
    ),
    KernelCheck(
        # The tensor-core kernel over batched storage: sequences of different lengths in scattered
        # pages (of 16, 32 and 64 slots), each with its own ring and full-precision rows; every
        # served (key, value) bits pair, both head sizes and query dtypes; forced splits.
        name="paged_decode_attention_mma",
        kernel=mma_paged_decode_attention,
        reference=paged.paged_decode_attention_reference,
        make_inputs=make_paged_inputs,
        cases=(
            {},
            {"lengths": (5,), "dtype": mx.float16, "head_dim": 64},
            {"lengths": (300, 1, 64, 129), "page_size": 64, "q_heads": 16, "kv_heads": 4, "key_bits": 4,
             "value_bits": 4},
            {"lengths": (1200, 37), "page_size": 32, "q_heads": 32, "kv_heads": 8, "key_bits": 8, "value_bits": 4},
            {"lengths": (700, 90), "key_bits": 8, "value_bits": 8, "dtype": mx.float16, "splits": 5},
            # aura4v2 in pages of 64: steps inside one page read as one run, a split's steps across two not
            {"lengths": (520, 130), "page_size": 64, "splits": 3},
            # more sequences than a GPU's wave holds threadgroups (21 x 8 KV heads): one split each
            {"lengths": (200,) * 20 + (1300,), "page_size": 64, "q_heads": 32, "kv_heads": 8},
        ),
        rtol=ATTENTION_RTOL,
        backends=frozenset({"cuda"}),  # 64 KB of dynamic shared memory, which Metal's custom kernels lack
        tensor_cores=True,
        kernel_options=("splits",),
    ),
    KernelCheck(
        name="dequantize",
        kernel=dequantize_kernel_joined,
        reference=dequantize_reference_joined,
        make_inputs=make_dequantize_inputs,
        cases=(
            {"length": 1, "allocated": 16},
            {"length": 300, "allocated": 512, "dtype": mx.float16, "key_bits": 8, "value_bits": 4},
            {"length": 100, "allocated": 256, "dtype": mx.float32, "head_dim": 64, "key_bits": 3, "value_bits": 2,
             "group": 32, "batch": 2},
            {"length": 60, "allocated": 64, "kv_heads": 3, "sinks": 0, "recent": 7},
            {"length": 300, "allocated": 300, "ring_start": 4, "recent_end": 37},
            {"length": 48, "allocated": 48, "ring_start": 10, "recent_end": 12, "dtype": mx.float16},
        ),
        rtol=ATTENTION_RTOL,
    ),
)
"""Every AURA kernel with its reference, for the conformance suite and bench/gpu_aura.py."""
