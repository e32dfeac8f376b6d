"""What a decode step pays for the slice assignments of its appends: six per layer (one per
buffer) against two (one per stack, ``butter_core.slots.Stacks``).

28 layers, each holding affine4-shaped buffers (8 KV heads, 4352 slots, head_dim 128:
16 uint32 words of codes and 4 bf16 scales or biases per row); every step writes one
row into each layer and evaluates. Reports host time to build the step's graph and
time to evaluate it, ms per step, each mode twice, alternating.

Usage: python3 bench/slot_writes.py   (any MLX backend; the default device)
"""

from __future__ import annotations

import time

import mlx.core as mx

LAYERS, KV_HEADS, SLOTS, WORDS, GROUPS = 28, 8, 4352, 16, 4
ROWS = ((WORDS, mx.uint32), (GROUPS, mx.bfloat16), (GROUPS, mx.bfloat16)) * 2
"""Widths and dtypes of the six buffers: key codes, scales, biases, then the values'."""


def step_times(stacked: bool, steps: int = 40, warmup: int = 5) -> tuple[float, float]:
    """(build ms, eval ms) per step, averaged over ``steps - warmup`` steps."""
    if stacked:
        layers = [(mx.zeros((2, 1, KV_HEADS, SLOTS, WORDS), mx.uint32),
                   mx.zeros((4, 1, KV_HEADS, SLOTS, GROUPS), mx.bfloat16)) for _ in range(LAYERS)]
        rows = [mx.ones((2, 1, KV_HEADS, 1, WORDS), mx.uint32), mx.ones((4, 1, KV_HEADS, 1, GROUPS), mx.bfloat16)]
    else:
        layers = [tuple(mx.zeros((1, KV_HEADS, SLOTS, w), dt) for w, dt in ROWS) for _ in range(LAYERS)]
        rows = [mx.ones((1, KV_HEADS, 1, w), dt) for w, dt in ROWS]
    mx.eval(layers, rows)
    build = evaluate = 0.0
    for step in range(steps):
        at = 100 + step
        start = time.perf_counter()
        for buffers in layers:
            for buffer, row in zip(buffers, rows):
                buffer[..., at : at + 1, :] = row
        built = time.perf_counter()
        mx.eval([buffer for buffers in layers for buffer in buffers])
        done = time.perf_counter()
        if step >= warmup:
            build += built - start
            evaluate += done - built
    n = steps - warmup
    return 1e3 * build / n, 1e3 * evaluate / n


def main() -> None:
    print(f"MLX {mx.__version__}, {mx.default_device()}, {LAYERS} layers, one row per layer and step")
    for _ in range(2):
        for stacked in (False, True):
            build, evaluate = step_times(stacked)
            label = "two stacks" if stacked else "six buffers"
            print(f"  {label:12s} build {build:5.2f} ms/step  eval {evaluate:5.2f} ms/step  "
                  f"total {build + evaluate:5.2f}", flush=True)


if __name__ == "__main__":
    main()
