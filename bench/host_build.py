"""Host time to build one decode step's attention on the CUDA path, measured on any machine.

A decode step on MLX's CUDA backend is bound by host time (docs/benchmarks.md, issue 32):
what the Python around each layer's kernels costs is paid on the GPU machine as it is here.
Inside ``standing_in_for_gpu`` and ``kernels.executed_by("cuda", ...)`` every cache takes
its GPU path and every kernel call returns ready-made zeros instead of running, so the time
to build ``--layers`` layers' ``update_and_attend`` (one token: its append and attention) is
the host's share before MLX's own per-call cost (on the H200: ~2.6 µs to build and ~4.1 µs
to evaluate each custom-kernel call, GPU-NOTES.md). Schemes whose CUDA path replays an
``mx.compile`` trace build no kernel call per step once traced; the first steps trace.

Per scheme: build µs per layer, the median of ``--rounds`` rounds (the paths interleaved)
of each round's median over ``--steps`` steps (after ``WARMUP``), at
``--context`` positions, bf16, 32 query / 8 KV heads, head_dim 128. ``mx.fast.sdpa`` with
mlx-lm's slice-assigned append is the floor (its graph is two ``SliceUpdate``s, two slices
and one SDPA node on a GPU; on a CPU MLX builds SDPA from several ops, so the floor here is
above the GPU's).

With ``--batch B``, the same for one step of ``B`` sequences over paged storage
(``BatchedCaches``, ``--page-size``): each layer's ``BatchedLayer.update_and_attend`` for one
token per sequence, and the step's shared ``Placement``, per layer. The sequences are
prefilled to ``--context`` positions first (on the CPU, so keep it small: the page table's
size is what the host pays for, 512 positions is 8 pages of 64). Relative to butter raw's.

Usage: python bench/host_build.py [--kv-cache raw,affine4,aura4v2] [--context 4096] [--rounds 5] [--profile SCHEME]
           [--batch B [--page-size 64]]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import pstats
import re
import statistics
import tempfile
import time
from collections import Counter

import butter_core  # noqa: F401 - before mlx.core
import mlx.core as mx

from butter_core import parse_kv_cache
from butter_core.batched import PAGE_SIZE, BatchedCaches
from butter_core.cache import LayerSpec
from butter_core.kernels.backend import standing_in_for_gpu
from butter_core.kernels.kernel import executed_by
from butter_core.layer_caches import make_layer_caches

WARMUP = 5
Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def zeros_for_kernels(launch) -> list[mx.array]:
    """An executor for ``executed_by``: a kernel call's outputs as zeros that depend on its inputs
    (``mx.depends``: one node for the call, as a kernel call is one node of the graph, and what
    feeds the kernel stays in the graph and in a trace of it)."""
    zeros = [_zeros(tuple(shape), dtype) for shape, dtype in zip(launch.output_shapes, launch.build.output_dtypes)]
    return mx.depends(zeros, list(launch.inputs))


@contextlib.contextmanager
def fast_ops_as_on_gpu():
    """Within this block ``mx.fast``'s RMSNorm, RoPE and attention are one node each, as a GPU
    builds them (a CPU builds each from several operations): zeros that depend on their inputs
    (``zeros_for_kernels``'s stand-in), so a graph's node count is the one a GPU encodes."""
    names = ("rms_norm", "rope", "scaled_dot_product_attention")
    originals = {name: getattr(mx.fast, name) for name in names}

    def stand_in(x, *args, **kwargs):
        inputs = [a for a in (*args, *kwargs.values()) if isinstance(a, mx.array)]
        return mx.depends([_zeros(tuple(x.shape), x.dtype)], [x, *inputs])[0]

    try:
        for name in names:
            setattr(mx.fast, name, stand_in)
        yield
    finally:
        for name, original in originals.items():
            setattr(mx.fast, name, original)


@functools.cache
def _zeros(shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
    """Evaluated zeros of this shape: a leaf of the graph, so a stand-in call adds only its
    ``Depends`` node."""
    zeros = mx.zeros(shape, dtype)
    mx.eval(zeros)
    return zeros


def node_kinds(outputs: list[mx.array]) -> Counter:
    """The operations evaluating ``outputs`` runs (their graph down to evaluated arrays, as
    ``mx.export_to_dot`` draws it), counted by kind, a stand-in kernel counting one ``Depends``:
    each is a node MLX builds (or a trace replays) on the host and encodes at evaluation."""
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as dot:
        mx.export_to_dot(dot.name, *outputs)
        text = dot.read()
    return Counter(label.split()[0] for label in re.findall(r'label\s*=\s*"([^"]*)"[^\]]*shape=rectangle', text))


def graph_nodes(outputs: list[mx.array]) -> int:
    """How many operations evaluating ``outputs`` runs (``node_kinds``, all kinds)."""
    return sum(node_kinds(outputs).values())


def floor_step(layers: int, context: int, steps: int):
    """mlx-lm's decode attention per layer: slice-assign the token, SDPA over the live slice."""
    keys = [mx.zeros((1, KV_HEADS, context + steps + WARMUP, HEAD_DIM), mx.bfloat16) for _ in range(layers)]
    values = [mx.zeros_like(k) for k in keys]
    mx.eval(keys, values)
    offset = [context]

    def step(q, k, v):
        n = offset[0]
        outs = []
        for i in range(layers):
            keys[i][..., n : n + 1, :] = k
            values[i][..., n : n + 1, :] = v
            outs.append(mx.fast.scaled_dot_product_attention(q, keys[i][..., : n + 1, :], values[i][..., : n + 1, :],
                                                             scale=HEAD_DIM**-0.5))  # fmt: skip
        offset[0] += 1
        return outs

    return step


def scheme_step(name: str, layers: int, context: int, steps: int):
    spec = LayerSpec(KV_HEADS, HEAD_DIM, context + steps + WARMUP + 8, mx.bfloat16)
    caches = make_layer_caches(parse_kv_cache(name), [spec] * layers)
    chunk = mx.zeros((1, KV_HEADS, min(context, 1024), HEAD_DIM), mx.bfloat16)
    for cache in caches:
        for _ in range(context // chunk.shape[2]):
            cache.append(chunk, chunk)
    mx.eval([cache.state() for cache in caches])
    return lambda q, k, v: [cache.update_and_attend(q, k, v, scale=HEAD_DIM**-0.5) for cache in caches]


def batched_step(name: str, layers: int, batch: int, context: int, steps: int, page_size: int):
    """One decode step of ``batch`` sequences of ``context`` positions over paged storage."""
    positions = context + steps + WARMUP + 1
    specs = [LayerSpec(KV_HEADS, HEAD_DIM, positions, mx.bfloat16, layer_index=i) for i in range(layers)]
    caches = BatchedCaches(specs, make_layer_caches(parse_kv_cache(name), specs), page_size=page_size,
                           capacity_tokens=batch * (positions + page_size), max_sequences=batch)
    handles = [caches.open() for _ in range(batch)]
    for handle in handles:
        caches.reserve(handle, positions)

    def step(q, k, v):
        tokens = k.shape[2]
        batched = caches.step(handles, tokens)
        q, k, v = (mx.broadcast_to(x, (batch, x.shape[1], tokens, HEAD_DIM)) for x in (q, k, v))
        outs = [view.update_and_attend(q, k, v, scale=HEAD_DIM**-0.5) for view in caches.views(batched)]
        batched.advance()
        return outs

    chunk = mx.zeros((1, Q_HEADS, context, HEAD_DIM), mx.bfloat16)
    mx.eval(step(chunk, chunk[:, :KV_HEADS], chunk[:, :KV_HEADS]))
    return step


def build_us(step, q, k, v, steps: int, layers: int, profile: cProfile.Profile | None = None) -> float:
    times = []
    for n in range(WARMUP + steps):
        if profile is not None and n >= WARMUP:
            profile.enable()
        start = time.perf_counter()
        outs = step(q, k, v)
        times.append(time.perf_counter() - start)
        if profile is not None:
            profile.disable()
        mx.eval(outs)
    return 1e6 * statistics.median(times[WARMUP:]) / layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-cache", default="raw,affine4,aura4v2")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profile", metavar="SCHEME", help="print a cProfile of that scheme's steps instead")
    parser.add_argument("--batch", type=int, help="time a step of this many sequences over paged storage instead")
    parser.add_argument("--page-size", type=int, default=PAGE_SIZE)
    args = parser.parse_args()
    q = mx.zeros((1, Q_HEADS, 1, HEAD_DIM), mx.bfloat16)
    k = v = mx.zeros((1, KV_HEADS, 1, HEAD_DIM), mx.bfloat16)
    total = (WARMUP + args.steps) * args.rounds

    def make_step(name):
        if args.batch:
            return batched_step(name, args.layers, args.batch, args.context, total, args.page_size)
        return scheme_step(name, args.layers, args.context, total)

    with standing_in_for_gpu(), executed_by("cuda", zeros_for_kernels):
        if args.profile:
            profile = cProfile.Profile()
            build_us(make_step(args.profile), q, k, v, args.steps, args.layers, profile)
            pstats.Stats(profile).sort_stats("tottime").print_stats(20)
            return
        batched = f"; {args.batch} sequences, pages of {args.page_size}" if args.batch else ""
        print(f"MLX {mx.__version__}; host µs per layer to build one decode step's append + attention on the CUDA "
              f"path; {args.layers} layers, context {args.context}, bf16{batched}; the median of {args.rounds} "
              f"interleaved rounds' medians of {args.steps} steps")  # fmt: skip
        paths = {} if args.batch else {"slice-assign + mx.fast.sdpa": floor_step(args.layers, args.context, total)}
        paths |= {f"butter {name}": make_step(name) for name in args.kv_cache.split(",")}
        rounds = {name: [] for name in paths}
        for _ in range(args.rounds):
            for name, step in paths.items():
                rounds[name].append(build_us(step, q, k, v, args.steps, args.layers))
        nodes = {}
        for name, step in paths.items():
            outs = step(q, k, v)
            nodes[name] = graph_nodes(outs) / args.layers
            mx.eval(outs)
        first = statistics.median(next(iter(rounds.values())))  # the floor, or butter raw's with --batch
        print(f"{'path':<28} {'µs':>6}  {'/first':>6}  {'nodes/layer':>11}   rounds")
        for name, values in rounds.items():
            us = statistics.median(values)
            print(f"{name:<28} {us:6.1f}  {us / first:5.2f}x  {nodes[name]:11.1f}   {' '.join(f'{x:.1f}' for x in values)}")


if __name__ == "__main__":
    main()
