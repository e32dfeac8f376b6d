"""AURA's batched decode (``FullPrecisionRows.paged_decode``: on the CPU ``cpu.gathered_decode_attention``,
on a GPU ``kernels.paged``, here through the CUDA emulator) against each sequence's own ``AuraCache``
fed the same rows: coded slots, full-precision rows and sequences of different lengths, with and
without a window."""

from __future__ import annotations

import contextlib

import mlx.core as mx
import pytest

from butter_core import LayerSpec, Window, make_layer_caches, parse_kv_cache
from butter_core.batched import BatchedCaches
from butter_core.kernels import standing_in_for_gpu
from butter_core.kernels.cuda_emulator import emulated_cuda
from butter_core.kernels.metal_emulator import compiler_available

from butter_aura.kernels import GPU_OPS

LENGTHS = [70, 9, 45]
"""Past the full-precision budget (4 sinks and 32 recent rows), within it, and between."""
LAYERS, DECODE_STEPS = 2, 3


def _chunk(sequences: int, tokens: int, seed: int) -> tuple[mx.array, mx.array, mx.array]:
    """Queries of 4 heads, keys and values of 2, ``tokens`` each, for ``sequences``."""
    q = mx.random.normal((sequences, 4, tokens, 64), key=mx.random.key(seed))
    k, v = mx.random.normal((2, sequences, 2, tokens, 64), key=mx.random.key(seed + 1))
    return q, k, v


@contextlib.contextmanager
def _cuda_emulated():
    """The GPU's path (``FullPrecisionRows.paged_decode`` over the rings a step shares), its kernels
    run by the CUDA emulator."""
    with standing_in_for_gpu(), emulated_cuda():
        yield


PATHS = {"default": contextlib.nullcontext, "cuda-emulated": _cuda_emulated}
"""The machine's own path (on the CPU: pages gathered and decoded), and the GPU's, emulated."""


@pytest.mark.parametrize("path", [pytest.param("default"), pytest.param("cuda-emulated", marks=pytest.mark.skipif(
    not compiler_available(), reason="the CUDA emulator needs g++ 12+ (_Float16)"))])
@pytest.mark.parametrize("window", [None, Window(40, keep=4)], ids=["no-window", "window40"])
def test_batched_decode_matches_each_sequences_own_cache(window, path):
    """Two layers (sharing their rings in batched storage), three sequences prefilled in chunks, then
    three decode steps: each layer's batched output for each sequence is what its own cache gives (the
    same arithmetic on the CPU; through kernels, float32 sums in another order, whose checks allow 2e-5
    of the largest output)."""
    kind = parse_kv_cache("aura4v2")
    spec = LayerSpec(n_kv_heads=2, head_dim=64, max_positions=256, dtype=mx.float32)
    singles = [make_layer_caches(kind, [spec] * LAYERS, window) for _ in LENGTHS]  # the machine's own path, made
    with PATHS[path]():  # outside (a cache takes its path when made): the reference each batched output meets
        prototypes = make_layer_caches(kind, [spec] * LAYERS)
        kernels = prototypes[0].ops is GPU_OPS
        assert kernels or path == "default"
        caches = BatchedCaches([spec] * LAYERS, prototypes, capacity_tokens=512, page_size=8, windows=[window] * LAYERS)
        handles = [caches.open() for _ in LENGTHS]
        for index, (handle, layers, length) in enumerate(zip(handles, singles, LENGTHS)):
            caches.reserve(handle, length + DECODE_STEPS)
            for start in range(0, length, 16):  # the prompt in chunks, as a prefill writes it
                step = caches.step([handle], min(16, length - start))
                for layer, (view, single) in enumerate(zip(caches.views(step), layers)):
                    q, k, v = _chunk(1, step.tokens, seed=index * 100 + start + layer * 10_000)
                    view.update_and_attend(q, k, v, scale=0.125)
                    single.update_and_attend(q, k, v, scale=0.125)
                step.advance()
        for n in range(DECODE_STEPS):
            step = caches.step(handles, 1)
            for layer, view in enumerate(caches.views(step)):
                q, k, v = _chunk(len(LENGTHS), 1, seed=999 + n + layer * 10_000)
                batched = view.update_and_attend(q, k, v, scale=0.125)
                for row, layers in enumerate(singles):
                    alone = layers[layer].update_and_attend(q[row : row + 1], k[row : row + 1], v[row : row + 1],
                                                            scale=0.125)  # fmt: skip
                    error = (mx.abs(batched[row : row + 1] - alone).max() / mx.abs(alone).max()).item()
                    assert error < (1e-4 if kernels else 1e-5), (n, layer, row, LENGTHS[row], error)
            step.advance()


@pytest.mark.parametrize(("window", "path"), [
    pytest.param(None, "default", id="no-window-default"),
    pytest.param(Window(40, keep=4), "default", id="window40-default"),
    pytest.param(None, "cuda-emulated", id="no-window-cuda-emulated", marks=pytest.mark.skipif(
        not compiler_available(), reason="the CUDA emulator needs g++ 12+ (_Float16)")),
])  # fmt: skip
def test_decode_tokens_codes_wait_in_their_rows_until_the_ring_moves_on(window, path):
    """A decode step's tokens are copied into their full-precision rows only, and coded a ring of steps
    later (``FullPrecisionRows.defer``/``flush``): over 40 decode steps (past the 32 recent rows, so
    codes written late are read), with a sequence exported mid-way (which writes every pending code
    first) and one released and its slot reused (its pending codes dropped, never written into pages
    that are now another sequence's), each sequence's output is still its own cache's."""
    kind = parse_kv_cache("aura4v2")
    spec = LayerSpec(n_kv_heads=2, head_dim=64, max_positions=256, dtype=mx.float32)
    singles = [make_layer_caches(kind, [spec] * LAYERS, window) for _ in range(len(LENGTHS) + 1)]  # the machine's
    joining = singles.pop()  # the sequence that takes a released one's slot
    seed = [0]

    def chunk(sequences, tokens):
        seed[0] += 1
        return _chunk(sequences, tokens, seed[0])

    def join(length, layers):
        handle = caches.open()
        caches.reserve(handle, length + 50)
        for start in range(0, length, 16):
            step = caches.step([handle], min(16, length - start))
            for view, single in zip(caches.views(step), layers):
                q, k, v = chunk(1, step.tokens)
                view.update_and_attend(q, k, v, scale=0.125)
                single.update_and_attend(q, k, v, scale=0.125)
            step.advance()
        return handle

    with PATHS[path]():
        prototypes = make_layer_caches(kind, [spec] * LAYERS)
        kernels = prototypes[0].ops is GPU_OPS
        caches = BatchedCaches([spec] * LAYERS, prototypes, capacity_tokens=640, page_size=8, windows=[window] * LAYERS)
        rings = caches.states[0].rings
        handles = [join(length, layers) for length, layers in zip(LENGTHS, singles)]
        for n in range(40):
            if n == 20:
                snapshot = caches.export_sequence(handles[1])
                assert not rings.pending and not rings.sealed
                assert snapshot.length == caches.length(handles[1])
            if n == 25:  # the first sequence leaves with codes pending; a new one takes its slot (and pages)
                assert any(owner == handles[0].slot for owner, _ in rings.pending.values())
                caches.release(handles[0])
                assert all(owner != handles[0].slot for owner, _ in rings.pending.values())
                handles[0], singles[0] = join(12, joining), joining
            step = caches.step(handles, 1)
            for layer, view in enumerate(caches.views(step)):
                q, k, v = chunk(len(handles), 1)
                batched = view.update_and_attend(q, k, v, scale=0.125)
                for row, layers in enumerate(singles):
                    alone = layers[layer].update_and_attend(q[row : row + 1], k[row : row + 1], v[row : row + 1],
                                                            scale=0.125)  # fmt: skip
                    error = (mx.abs(batched[row : row + 1] - alone).max() / mx.abs(alone).max()).item()
                    assert error < (1e-4 if kernels else 1e-5), (n, layer, row, error)
            step.advance()
            assert len(rings.pending) > 0  # this step's tokens wait for their codes
