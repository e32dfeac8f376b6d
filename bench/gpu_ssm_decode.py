"""butter-ssm's fused decode steps on the GPU against the mixers' MLX-ops reference, per layer.

Run on a machine with a GPU backend (the lent H200, or Apple silicon), with mlx, butter-core
and butter-ssm installed:

    python3 bench/gpu_ssm_decode.py            # about a minute on an H200

Two layers, model dtype bfloat16, random weights of a real layer's scale, batch 1 and 32, the
state kept in float32 (butter-ssm's default) and in bfloat16:

- gated delta, Qwen3-Next-80B-like: Hv 32 value heads, Hk 16 key heads, Dk = Dv = 128, conv 4
  (state 2 MiB per sequence in float32);
- Mamba2, Mamba2-2.7B-like: H 128 heads of P 64, N 128, G 8 groups, conv 4 (4 MiB).

Each path runs one-token updates through ``SSMCache.update_and_mix``, as a model's decode does:
``fused`` with ``ops_for(spec)`` (one kernel launch per layer and token), ``mlx ops`` with the
mixer's reference (``butter_core.recurrent``: ~20 MLX ops per layer and token). The states of
``layers`` caches total at least ``L2_DEFEAT_BYTES``, so a layer's state is not in L2 when its
next token comes, as in a real model. Columns, per layer and token:

- ``chain µs``: ``TOKENS`` tokens through every layer, each state fed to the next token, built
  as one graph and evaluated once, divided by tokens x layers (the GPU's cost where the host
  keeps ahead of it; at batch 1 the host's cost per call can be the larger, see ``host µs``);
- ``step µs``: one token through every layer, then ``mx.eval`` (what a decode step costs, host
  included), the median over ``TOKENS`` tokens, divided by layers;
- ``host µs``: the host building one call's graph (Python and MLX, not evaluated);
- ``of floor``: the state bytes floor (the state read once and written once, at the copy
  bandwidth this script measures: a ``COPY_BYTES`` array added to 0) divided by ``chain µs``.

Before timing, the fused step is checked against the reference at each timed shape (relative
error of output and state, on the GPU: float32 matmuls there are TF32-like, ~1e-3).
"""

from __future__ import annotations

import statistics
import sys
import time

import mlx.core as mx

from butter_core.kernels import default_device_is_gpu, gpu_backend, relative_error
from butter_core.recurrent import GATED_DELTA, MAMBA2, StateSpec

from butter_ssm import SSM, SSMCache
from butter_ssm.kernels import ops_for
from butter_ssm.kernels.checks import make_gated_delta_inputs, make_mamba2_inputs

BATCHES = (1, 32)
TOKENS = 8
REPEATS = 3
L2_DEFEAT_BYTES = 512 * 2**20
"""Bytes of state the timed layers hold together (an H200's L2 is 60 MB)."""
MAX_LAYERS = 128
COPY_BYTES = 2 * 2**30
DTYPE = mx.bfloat16

SHAPES = {
    "gated delta Hv32 Hk16 D128": (GATED_DELTA, make_gated_delta_inputs,
                                   {"key_heads": 16, "value_heads": 32, "key_dim": 128, "value_dim": 128}),
    "mamba2 H128 P64 N128 G8": (MAMBA2, make_mamba2_inputs,
                                {"heads": 128, "head_dim": 64, "groups": 8, "state_size": 128}),
}


def copy_bandwidth() -> float:
    """Bytes per second read plus written by ``x + 0`` over a ``COPY_BYTES`` float32 array (best of 5)."""
    x = mx.zeros((COPY_BYTES // 4,), dtype=mx.float32)
    mx.eval(x)
    best = float("inf")
    for _ in range(6):
        start = time.perf_counter()
        y = x + 0.0
        mx.eval(y)
        best = min(best, time.perf_counter() - start)
        del y
    return 2 * COPY_BYTES / best


def _caches(layer_type: str, inputs: dict, state_dtype: str, layers: int, fused: bool) -> list[SSMCache]:
    state, conv = inputs["state"], inputs["conv_state"]
    spec = StateSpec(layer_type, conv_dim=conv.shape[2], conv_kernel=conv.shape[1] + 1, state_shape=tuple(state.shape[1:]),
                     dtype=DTYPE, batch_size=state.shape[0])
    kind = SSM(state_dtype=state_dtype)
    caches = []
    for _ in range(layers):
        cache = SSMCache(spec, kind, ops=ops_for(spec) if fused else None)
        cache.restore({"conv": conv, "state": state.astype(cache.state_dtype)}, {"position": 0})
        caches.append(cache)
    if fused and caches[0].ops is None:
        raise RuntimeError("ops_for chose no kernel here: is MLX's default device a GPU?")
    return caches


def _time_path(caches: list[SSMCache], mixer, token_inputs: list[mx.array]) -> dict:
    def states():
        return [c.state()["state"] for c in caches]

    for cache in caches:  # compile and warm up
        cache.update_and_mix(mixer, *token_inputs)
    mx.eval(states())
    mx.clear_cache()
    chain, host = [], []
    for _ in range(REPEATS):
        mx.synchronize()
        start = time.perf_counter()
        outs = []
        for _ in range(TOKENS):
            for cache in caches:
                outs.append(cache.update_and_mix(mixer, *token_inputs))
        built = time.perf_counter()
        mx.eval(outs, states())
        mx.synchronize()
        done = time.perf_counter()
        calls = TOKENS * len(caches)
        chain.append((done - start) / calls * 1e6)
        host.append((built - start) / calls * 1e6)
        del outs
    steps = []
    for _ in range(TOKENS):
        mx.synchronize()
        start = time.perf_counter()
        outs = [cache.update_and_mix(mixer, *token_inputs) for cache in caches]
        mx.eval(outs, states())
        steps.append((time.perf_counter() - start) / len(caches) * 1e6)
        del outs
    return {"chain": min(chain), "step": statistics.median(steps), "host": statistics.median(host)}


def _check(layer_type: str, inputs: dict, state_dtype: str) -> tuple[float, float]:
    """The fused step against the reference (both on the GPU) at this shape: output, state."""
    fused, plain = (_caches(layer_type, inputs, state_dtype, 1, f)[0] for f in (True, False))
    token = [v for k, v in inputs.items() if k not in ("mixer", "conv_state", "state")]
    out, expected = fused.update_and_mix(inputs["mixer"], *token), plain.update_and_mix(inputs["mixer"], *token)
    return relative_error(out, expected), relative_error(fused.state()["state"], plain.state()["state"])


def main() -> int:
    if gpu_backend() is None or not default_device_is_gpu():
        print("needs a GPU backend (Metal or CUDA) as MLX's default device")
        return 1
    bandwidth = copy_bandwidth()
    print(f"MLX {mx.__version__}, {gpu_backend()}, {mx.device_info(mx.Device(mx.gpu, 0)).get('device_name', '')}; "
          f"copy bandwidth (x + 0, {COPY_BYTES >> 30} GiB) {bandwidth / 1e12:.2f} TB/s; model dtype bfloat16")
    header = (f"{'layer':<27} {'batch':>5} {'state':>8} {'state MiB':>9} {'layers':>6} {'path':<8} "
              f"{'chain µs':>9} {'step µs':>8} {'host µs':>8} {'of floor':>8}  check (out, state)")
    print(header)
    print("-" * len(header))
    for name, (layer_type, make_inputs, case) in SHAPES.items():
        for batch in BATCHES:
            for state_dtype in ("float32", "bfloat16"):
                inputs = make_inputs(0, batch=batch, dtype=DTYPE, **case)
                errors = _check(layer_type, inputs, state_dtype)
                state_bytes = inputs["state"].size * (4 if state_dtype == "float32" else 2)
                layers = max(2, min(MAX_LAYERS, -(-L2_DEFEAT_BYTES // state_bytes)))
                floor_us = 2 * state_bytes / bandwidth * 1e6
                token = [v for k, v in inputs.items() if k not in ("mixer", "conv_state", "state")]
                for fused in (True, False):
                    caches = _caches(layer_type, inputs, state_dtype, layers, fused)
                    t = _time_path(caches, inputs["mixer"], token)
                    del caches
                    mx.clear_cache()
                    print(f"{name:<27} {batch:>5} {state_dtype:>8} {state_bytes / 2**20:>9.1f} {layers:>6} "
                          f"{'fused' if fused else 'mlx ops':<8} {t['chain']:>9.1f} {t['step']:>8.1f} "
                          f"{t['host']:>8.1f} {floor_us / t['chain']:>8.1%}"
                          + (f"  {errors[0]:.1e}, {errors[1]:.1e}" if fused else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
