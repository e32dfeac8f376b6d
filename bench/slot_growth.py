"""What a long prompt pays for its cache's storage growing, against writes into storage
allocated once: the issue-30 measurement.

One layer (8 KV heads, head_dim 128, float16, the raw scheme), positions appended in
512-token chunks through the public ``append``, evaluated after every chunk as a prefill
is. Three ways: ``grown`` (no reservation: ``SlotBuffers`` grows on demand), ``reserved``
(``cache.reserve(positions)`` first, as the engine does when it knows prompt +
max_tokens) and ``preallocated`` (slice assignment into one array of the final size, no
cache: the floor). Reports ms per context and the ratio to the floor, each mode in
alternating order, median of ``--reps``.

Usage: python3 bench/slot_growth.py [--contexts 8192 16384 32768] [--reps 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx

from butter_core import LayerSpec, make_layer_caches
from butter_raw import Raw

HEADS, DIM, CHUNK = 8, 128, 512


def run(mode: str, positions: int) -> float:
    chunk = mx.random.normal((1, HEADS, CHUNK, DIM)).astype(mx.float16)
    mx.eval(chunk)
    start = time.perf_counter()
    if mode == "preallocated":
        keys, values = (mx.zeros((1, HEADS, positions, DIM), mx.float16) for _ in range(2))
        mx.eval(keys, values)
        for at in range(0, positions, CHUNK):
            keys[..., at : at + CHUNK, :] = chunk
            values[..., at : at + CHUNK, :] = chunk
            mx.eval(keys, values)
    else:
        (cache,) = make_layer_caches(Raw(), [LayerSpec(HEADS, DIM, positions, mx.float16)])
        if mode == "reserved":
            cache.reserve(positions)
        for _ in range(0, positions, CHUNK):
            cache.append(chunk, chunk)
            mx.eval(cache.state())
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    modes = ["grown", "reserved", "preallocated"]
    print(f"MLX {mx.__version__}, {mx.default_device()}; ms per prefill of one layer, median of {args.reps}")
    print("| positions | " + " | ".join(modes) + " | grown / preallocated | reserved / preallocated |")
    print("|---:|" + "---:|" * (len(modes) + 2))
    for positions in args.contexts:
        times = {mode: [] for mode in modes}
        for rep in range(args.reps):
            for mode in modes[rep % len(modes) :] + modes[: rep % len(modes)]:
                times[mode].append(run(mode, positions))
        ms = {mode: statistics.median(values) for mode, values in times.items()}
        floor = ms["preallocated"]
        cells = " | ".join(f"{ms[mode]:.0f}" for mode in modes)
        print(f"| {positions} | {cells} | {ms['grown'] / floor:.1f}x | {ms['reserved'] / floor:.1f}x |")


if __name__ == "__main__":
    main()
