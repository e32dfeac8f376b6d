"""AURA's batched decode on the CPU (``FullPrecisionRows.paged_decode``, ``cpu.gathered_decode_attention``)
against each sequence's own ``AuraCache`` fed the same rows: coded slots, full-precision rows and
sequences of different lengths, with and without a window."""

from __future__ import annotations

import mlx.core as mx
import pytest

from butter_core import LayerSpec, Window, make_layer_caches, parse_kv_cache
from butter_core.batched import BatchedCaches

LENGTHS = [70, 9, 45]
"""Past the full-precision budget (4 sinks and 32 recent rows), within it, and between."""


def _chunk(sequences: int, tokens: int, seed: int) -> tuple[mx.array, mx.array, mx.array]:
    """Queries of 4 heads, keys and values of 2, ``tokens`` each, for ``sequences``."""
    q = mx.random.normal((sequences, 4, tokens, 64), key=mx.random.key(seed))
    k, v = mx.random.normal((2, sequences, 2, tokens, 64), key=mx.random.key(seed + 1))
    return q, k, v


@pytest.mark.parametrize("window", [None, Window(40, keep=4)], ids=["no-window", "window40"])
def test_batched_decode_matches_each_sequences_own_cache(window):
    kind = parse_kv_cache("aura4v2")
    spec = LayerSpec(n_kv_heads=2, head_dim=64, max_positions=256, dtype=mx.float32)
    prototype = make_layer_caches(kind, [spec])[0]
    caches = BatchedCaches([spec], [prototype], capacity_tokens=512, page_size=8, windows=[window])
    handles = [caches.open() for _ in LENGTHS]
    singles = make_layer_caches(kind, [spec] * len(LENGTHS), window)
    for index, (handle, single, length) in enumerate(zip(handles, singles, LENGTHS)):
        caches.reserve(handle, length + 1)
        for start in range(0, length, 16):  # the prompt in chunks, as a prefill writes it
            q, k, v = _chunk(1, min(16, length - start), seed=index * 100 + start)
            step = caches.step([handle], q.shape[2])
            caches.views(step)[0].update_and_attend(q, k, v, scale=0.125)
            step.advance()
            single.update_and_attend(q, k, v, scale=0.125)
    q, k, v = _chunk(len(LENGTHS), 1, seed=999)
    batched = caches.views(caches.step(handles, 1))[0].update_and_attend(q, k, v, scale=0.125)
    for row, single in enumerate(singles):
        alone = single.update_and_attend(q[row : row + 1], k[row : row + 1], v[row : row + 1], scale=0.125)
        error = (mx.abs(batched[row : row + 1] - alone).max() / mx.abs(alone).max()).item()
        assert error < 1e-5, (row, LENGTHS[row], error)
