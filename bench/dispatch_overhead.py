"""What the plugin layer costs a decode step.

Runs a decode step of a SmolLM2-135M-shaped attention stack (30 layers, 9 query heads,
3 KV heads, head_dim 64) over caches holding ``--context`` positions, three ways,
interleaved in one run:

* ``direct``: RawCache objects constructed by hand, no plugin machinery at all;
* ``plugin``: caches from ``make_layer_caches`` (entry point → scheme → create), which
  is how butter runs models;
* ``hook-per-call``: the design we rejected, a pluggy hook call per layer per step
  in front of the same cache (shows what binding at creation saves).

Two times per variant: the whole step (graph built and evaluated) and the Python
time to build the step's graph alone, which is all a dispatch layer can add (on a
GPU the evaluation runs asynchronously, so building is the host-side cost per token).
Prints medians and the overhead ratios. Usage:
    python bench/dispatch_overhead.py [--context 1024] [--steps 200]
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
DTYPE = mx.float32  # the CPU runs models in float32 (fp16 arithmetic is slow there)

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
    args = parser.parse_args()

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
    print(f"mlx {mx.__version__} on {mx.default_device()}, {LAYERS} layers, context {args.context}, {args.steps} steps")
    print(f"  {'variant':14s} {'step ms':>9s} {'vs direct':>10s} {'build us':>9s} {'build/step':>10s}")
    for name in variants:
        print(
            f"  {name:14s} {step[name] * 1e3:9.3f} {step[name] / step['direct'] - 1:+10.2%} "
            f"{build[name] * 1e6:9.1f} {build[name] / step[name]:10.2%}"
        )
    extra = (build["hook-per-call"] - build["direct"]) / LAYERS
    print(f"  a pluggy call per layer would add ~{extra * 1e6:.2f} us per layer per step")


if __name__ == "__main__":
    main()
