"""What the plugin layer costs a decode step.

Runs a decode step of a SmolLM2-135M-shaped attention stack (30 layers, 9 query heads,
3 KV heads, head_dim 64) over caches holding ``--context`` positions, three ways,
interleaved in one run:

* ``direct``: RawCache objects constructed by hand, no plugin machinery at all;
* ``plugin``: caches from ``make_layer_caches`` (entry point → scheme → create), which
  is how butter runs models;
* ``hook-per-call``: the design we rejected, a pluggy hook call per layer per step
  in front of the same cache (shows what binding at creation saves);
* ``slice+sdpa``: no cache object of ours, mlx-lm's ``KVCache`` in miniature (preallocated
  buffers, two slice assignments, ``mx.fast.scaled_dot_product_attention`` over the live
  slice): the floor a cache wrapper is measured against (issue 32: butter raw's decode
  attention at most 1.05x SDPA called directly).

Two times per variant: the whole step (graph built and evaluated) and the Python
time to build the step's graph alone, which is all a dispatch layer can add (on a
GPU the evaluation runs asynchronously, so building is the host-side cost per token).
Prints medians and the overhead ratios. Usage:
    python bench/dispatch_overhead.py [--context 1024] [--steps 200] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
import pluggy

from butter_core import LayerSpec, make_layer_caches
from butter_raw import Raw
from butter_raw.cache import RawCache

LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM = 30, 9, 3, 64
DTYPE = mx.float32
"""The CPU runs models in float32 (fp16 arithmetic is slow there); ``--dtype bfloat16`` takes the path
a GPU decode takes (a float32 step on the CPU goes through ``cpu_attention.decode_attention``)."""

spec_marker = pluggy.HookspecMarker("butter_bench")
impl_marker = pluggy.HookimplMarker("butter_bench")


class Spec:
    @spec_marker(firstresult=True)
    def butter_bench_update_and_attend(cache, queries, keys, values, scale):
        """A per-call hook, as a design that dispatched append/attend through pluggy would have."""


class Impl:
    @impl_marker
    def butter_bench_update_and_attend(self, cache, queries, keys, values, scale):
        return cache.update_and_attend(queries, keys, values, scale=scale)


class SliceAssign:
    """mlx-lm's ``KVCache`` in miniature: the ``slice+sdpa`` variant."""

    def __init__(self, spec: LayerSpec):
        self.keys = mx.zeros((1, KV_HEADS, spec.max_positions, HEAD_DIM), DTYPE)
        self.values = mx.zeros_like(self.keys)
        self.offset = 0

    def append(self, keys, values):
        end = self.offset + keys.shape[2]
        self.keys[:, :, self.offset : end] = keys
        self.values[:, :, self.offset : end] = values
        self.offset = end

    def prepare_for_attention(self):
        return self.keys[:, :, : self.offset], self.values[:, :, : self.offset]

    def update_and_attend(self, queries, keys, values, *, scale):
        self.append(keys, values)
        live_keys, live_values = self.prepare_for_attention()
        return mx.fast.scaled_dot_product_attention(queries, live_keys, live_values, scale=scale)


def filled(caches, context):
    keys = mx.random.normal((1, KV_HEADS, context, HEAD_DIM)).astype(DTYPE)
    for cache in caches:
        cache.append(keys, keys)
    mx.eval([c.prepare_for_attention() for c in caches])
    return caches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()
    global DTYPE
    DTYPE = getattr(mx, args.dtype)

    specs = [LayerSpec(KV_HEADS, HEAD_DIM, args.context + args.steps * 3 + 8, DTYPE, i) for i in range(LAYERS)]
    pm = pluggy.PluginManager("butter_bench")
    pm.add_hookspecs(Spec)
    pm.register(Impl())
    hook = pm.hook.butter_bench_update_and_attend
    scale = HEAD_DIM**-0.5

    def direct_step(caches, q, k, v):
        return [c.update_and_attend(q, k, v, scale=scale) for c in caches]

    def hook_step(caches, q, k, v):
        return [hook(cache=c, queries=q, keys=k, values=v, scale=scale) for c in caches]

    variants = {
        "direct": (filled([RawCache(s, Raw()) for s in specs], args.context), direct_step),
        "plugin": (filled(make_layer_caches(Raw(), specs), args.context), direct_step),
        "hook-per-call": (filled([RawCache(s, Raw()) for s in specs], args.context), hook_step),
        "slice+sdpa": (filled([SliceAssign(s) for s in specs], args.context), direct_step),
    }
    q = mx.random.normal((1, Q_HEADS, 1, HEAD_DIM)).astype(DTYPE)
    k = mx.random.normal((1, KV_HEADS, 1, HEAD_DIM)).astype(DTYPE)
    mx.eval(q, k)
    step_times = {name: [] for name in variants}
    build_times = {name: [] for name in variants}
    for step in range(args.steps + 10):
        for name, (caches, run) in variants.items():
            start = time.perf_counter()
            outputs = run(caches, q, k, k)
            built = time.perf_counter()
            mx.eval(outputs)
            if step >= 10:  # warm-up
                build_times[name].append(built - start)
                step_times[name].append(time.perf_counter() - start)

    step = {name: statistics.median(t) for name, t in step_times.items()}
    build = {name: statistics.median(t) for name, t in build_times.items()}
    print(f"mlx {mx.__version__} on {mx.default_device()}, {LAYERS} layers, context {args.context}, {args.steps} steps, "
          f"{args.dtype}")
    print(f"  {'variant':14s} {'step ms':>9s} {'vs direct':>10s} {'build us':>9s} {'build/step':>10s}")
    for name in variants:
        print(
            f"  {name:14s} {step[name] * 1e3:9.3f} {step[name] / step['direct'] - 1:+10.2%} "
            f"{build[name] * 1e6:9.1f} {build[name] / step[name]:10.2%}"
        )
    extra = (build["hook-per-call"] - build["direct"]) / LAYERS
    print(f"  a pluggy call per layer would add ~{extra * 1e6:.2f} us per layer per step")
    print(f"  butter raw's host build per layer: {build['plugin'] / LAYERS * 1e6:.2f} us against slice+sdpa's "
          f"{build['slice+sdpa'] / LAYERS * 1e6:.2f} ({build['plugin'] / build['slice+sdpa']:.2f}x)")


if __name__ == "__main__":
    main()
