"""A decode step as a user meets it: every layer's attention per step, and whole-model decode, butter against mlx-lm in one process.

Wall clock, host included (issue 32's method, docs/benchmarks.md). Kernel-only figures
(``gpu_bench.py``) diagnose a kernel; these are the result.

1. **Per layer.** ``--layers`` independent layer caches per path (no L2 reuse between
   layers), 32 query / 8 KV heads, head_dim 128, bf16, each holding ``--context`` random
   positions. One decode step = every layer's one-token append and attention built, then
   evaluated together. Per step, on the host: ``build`` (the Python calls that return the
   outputs), ``encode`` (``mx.async_eval``, which returns once every kernel is launched)
   and ``wait`` (``mx.eval`` after it: the GPU still working once the host is done; near
   zero means the host sets the pace). Medians of ``--steps`` steps after
   ``WARMUP_STEPS``, per layer. Paths:

   - ``mx.fast.sdpa``: MLX's SDPA over full arrays, no append (the floor);
   - ``mlx-lm KVCache``: ``KVCache.update_and_fetch`` + ``mlx_lm.models.base.scaled_dot_product_attention``
     (what mlx-lm's model calls each layer);
   - ``mlx-lm 4-bit``: the same over ``QuantizedKVCache(group_size=64, bits=4)``;
   - ``butter <scheme>``: each ``--kv-cache`` scheme's ``update_and_attend``.

2. **End to end.** A Qwen3-1.7B-shaped model with random bf16 weights
   (``gpu_bench.QWEN3_1_7B``, ``max_position_embeddings`` raised to fit the longest
   context); mlx-lm's ``qwen3.Model`` holds the same weights. Per ``--e2e-context`` and
   round (``--rounds``, engine order rotating each round): a fresh cache, a prompt of random
   token ids prefilled, ``--decode-tokens`` greedy tokens. butter runs ``Generation`` (the
   loop of ``butter generate``); mlx-lm runs its ``generate_step`` loop restated (prefill in
   chunks of 2048 evaluated one by one, then each step's graph built while the previous
   evaluates, ``mx.async_eval``), because ``mlx_lm.generate`` imports transformers.
   Reported: prefill tok/s, decode tok/s (tokens after the first over the time after it),
   the first and the slowest decode step's time (a step that compiles a kernel shows there),
   and peak memory; medians over rounds. Before its rounds each engine warms up, as a
   server does before it listens (unless ``--no-warm-up``): butter with
   ``butter_core.warm_up`` for the context, mlx-lm (which has none) with a short run.
   Then (unless ``--interleave 0``) the engines decode ``--interleave-tokens`` each over one
   prompt each, taking turns of ``--interleave`` tokens (``interleaved_turns``): each engine's
   ratio to butter raw and to mlx-lm, paired turn by turn. Rounds a few seconds apart differ
   by tens of percent on the lent machines; turns a few milliseconds apart share the drift,
   so these ratios are the ones to quote.

3. **Latency after load** (``--latency``, instead of 1 and 2): per scheme, ``Model.load`` of a
   Qwen3-1.7B-shaped directory (random bf16 weights, written once to ``--model-dir``), then
   ``butter_core.warm_up`` (unless ``--no-warm-up``), then a 4096-token prompt and
   ``LATENCY_TOKENS`` greedy tokens: the warm-up's time, time to the first token, the first
   decode step, the median of the steady steps after it, and the slowest step. Run it twice with the same
   ``MLX_PTX_CACHE_DIR`` and ``BUTTER_CACHE_DIR`` (first empty) to see what kernels compiled
   once per install (the default: ``butter_core.kernels.cuda_binaries``) save a second
   process, against MLX's own per-process JIT (``BUTTER_CUDA_BINARIES=0``).

Usage (on the lent GPU, ``PYTHONPATH`` with butter and its plugins and mlx-lm):

    python3 bench/decode_step.py [--context 4096 32768 131072] [--e2e-context 4096 32768]
        [--kv-cache raw,affine4,aura4v2] [--steps 64] [--rounds 3] [--decode-tokens 64] [--prefill-chunk 2048 8192]
        [--interleave 8] [--interleave-tokens 256]
        [--skip-layers] [--skip-e2e] [--profile 'butter raw,butter aura4v2'] [--small]
        [--latency [--no-warm-up] [--model-dir DIR]]

``--small`` shrinks the heads, layers and model to run on a CPU as a check of the script.
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import pstats
import statistics
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

import butter_core  # noqa: F401 - before mlx.core (CPU BLAS selection)
import mlx.core as mx
from mlx.utils import tree_flatten

from butter_core import LoadOptions, parse_kv_cache
from butter_core.cache import LayerSpec
from butter_core.engine import Engine
from butter_core.generation import Generation
from butter_core.layer_caches import make_layer_caches
from butter_core.loading.weights import build_model
from butter_core.models.fused import fuse_projections
from butter_core.warm_up import warm_up
from gpu_batched import mlx_lm_module, pipelined_decode
from gpu_bench import QWEN3_1_7B, SMALL_MODEL

WARMUP_STEPS = 40
"""Steps before the timed ones: past every scheme's ``warm_up_steps`` (AURA's deferred
encode first runs at step 33), so no timed step compiles."""
FILL_CHUNK = 8192
LATENCY_TOKENS = 48
"""Tokens of the latency run: past AURA's deferred encode (step 33), which a warm-up that
stopped short of it would leave to compile mid-generation."""
def layer_paths(args, q_heads: int, kv_heads: int, dim: int):
    """name -> ``setup(context)`` returning a function that builds one decode step's outputs."""
    base = mlx_lm_module("models.base")
    cache_module = mlx_lm_module("models.cache")
    scale = dim**-0.5

    def chunks(context):
        for start in range(0, context, FILL_CHUNK):
            n = min(FILL_CHUNK, context - start)
            k = mx.random.normal((1, kv_heads, n, dim)).astype(mx.bfloat16)
            yield k, (k * 0.5).astype(mx.bfloat16)

    def sdpa(context):
        keys = [mx.random.normal((1, kv_heads, context, dim)).astype(mx.bfloat16) for _ in range(args.layers)]
        values = [k * 0.5 for k in keys]
        mx.eval(keys, values)
        return lambda q, k, v: [mx.fast.scaled_dot_product_attention(q, K, V, scale=scale) for K, V in zip(keys, values)]

    def mlx_lm(make):
        def setup(context):
            caches = [make() for _ in range(args.layers)]
            for k, v in chunks(context):
                for c in caches:
                    c.update_and_fetch(k, v)
                mx.eval([c.state for c in caches])

            def step(q, k, v):
                outs = []
                for c in caches:
                    keys, values = c.update_and_fetch(k, v)
                    outs.append(base.scaled_dot_product_attention(q, keys, values, cache=c, scale=scale, mask=None))
                return outs

            return step

        return setup

    def butter(kind):
        def setup(context):
            spec = LayerSpec(kv_heads, dim, context + WARMUP_STEPS + args.steps + 8, mx.bfloat16)
            caches = make_layer_caches(kind, [spec] * args.layers)
            for k, v in chunks(context):
                for c in caches:
                    c.append(k, v)
                mx.eval([c.state() for c in caches])
            return lambda q, k, v: [c.update_and_attend(q, k, v, scale=scale) for c in caches]

        return setup

    paths = {"mx.fast.sdpa": sdpa, "mlx-lm KVCache": mlx_lm(cache_module.KVCache),
             "mlx-lm 4-bit": mlx_lm(lambda: cache_module.QuantizedKVCache(group_size=64, bits=4))}  # fmt: skip
    for name in args.kv_cache:
        paths[f"butter {name}"] = butter(parse_kv_cache(name))
    return paths


def time_steps(step, q, k, v, steps: int, layers: int, profile: cProfile.Profile | None = None) -> dict[str, float]:
    """Per-layer medians (µs) of ``steps`` decode steps: build, encode, wait and their sum;
    and the mean wall (work a cache does every few steps, such as AURA's deferred encode,
    counts there and hardly in the median). With ``profile``, the timed steps' builds are
    profiled (which slows them: their times are then the profile's, not a result)."""
    parts = {"build": [], "encode": [], "wait": [], "wall": []}
    for n in range(WARMUP_STEPS + steps):
        if profile is not None and n >= WARMUP_STEPS:
            profile.enable()
        start = time.perf_counter()
        outs = step(q, k, v)
        built = time.perf_counter()
        if profile is not None:
            profile.disable()
        mx.async_eval(outs)
        encoded = time.perf_counter()
        mx.eval(outs)
        done = time.perf_counter()
        if n >= WARMUP_STEPS:
            for part, seconds in (("build", built - start), ("encode", encoded - built), ("wait", done - encoded),
                                  ("wall", done - start)):  # fmt: skip
                parts[part].append(seconds)
    return {part: 1e6 * statistics.median(values) / layers for part, values in parts.items()} | {
        "mean": 1e6 * statistics.fmean(parts["wall"]) / layers}


def layers_section(args, q_heads, kv_heads, dim) -> None:
    print(f"\n## Per layer: {args.layers} layers, {q_heads} q / {kv_heads} kv heads, D {dim}, bf16; "
          f"µs per layer, medians of {args.steps} steps\n")  # fmt: skip
    print("| context | path | wall | build | encode | wait | mean wall | wall / butter raw | wall / sdpa |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    paths = layer_paths(args, q_heads, kv_heads, dim)
    for context in args.context:
        q = mx.random.normal((1, q_heads, 1, dim)).astype(mx.bfloat16)
        k = mx.random.normal((1, kv_heads, 1, dim)).astype(mx.bfloat16)
        v = mx.random.normal((1, kv_heads, 1, dim)).astype(mx.bfloat16)
        mx.eval(q, k, v)
        results = {}
        for name, setup in paths.items():
            try:
                step = setup(context)
                results[name] = time_steps(step, q, k, v, args.steps, args.layers)
                del step
            except Exception as exc:  # noqa: BLE001 - one path failing (out of memory, no kernel) is reported
                results[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"}
            mx.clear_cache()
        if args.profile:
            profile_build(paths, args, context, q, k, v)
        raw = results.get("butter raw", {}).get("wall")
        sdpa = results["mx.fast.sdpa"].get("wall")
        for name, r in results.items():
            if "error" in r:
                print(f"| {context} | {name} | {r['error']} ||||||")
                continue
            ratio = f"{r['wall'] / raw:.2f}x" if raw else ""
            print(f"| {context} | {name} | {r['wall']:.1f} | {r['build']:.1f} | {r['encode']:.1f} | {r['wait']:.1f} | "
                  f"{r['mean']:.1f} | {ratio} | {r['wall'] / sdpa:.2f}x |", flush=True)  # fmt: skip


def profile_build(paths, args, context: int, q, k, v) -> None:
    """A cProfile of each ``--profile`` path's builds at ``context``: where the host's time per
    layer goes on this device (MLX's calls included, as the functions of ``mlx.core``)."""
    for name in args.profile:
        profile = cProfile.Profile()
        step = paths[name](context)
        time_steps(step, q, k, v, args.steps, args.layers, profile)
        print(f"\n### cProfile of `{name}`'s build at {context}: {args.steps} steps x {args.layers} layers\n\n```")
        pstats.Stats(profile).sort_stats("tottime").print_stats(args.profile_lines)
        print("```\n", flush=True)
        del step
        mx.clear_cache()


def mlx_lm_tokens(model, prompt: mx.array, decode: int) -> Iterator:
    """mlx-lm 0.32.2's ``generate_step`` for one prompt, as a stream: its prefill (made on the first
    ``next``), then pipelined greedy steps; each step's token as it arrives."""
    cache_module = mlx_lm_module("models.cache")
    caches = cache_module.make_prompt_cache(model)

    def step(token):
        return mx.argmax(model(token.reshape(1, 1), cache=caches)[:, -1], axis=-1)

    def tokens():
        ids = prompt[None]
        for offset in range(0, prompt.size - 1, 2048):
            model(ids[:, offset : min(offset + 2048, prompt.size - 1)], cache=caches)
            mx.eval([c.state for c in caches])
            mx.clear_cache()
        yield from pipelined_decode(step, prompt[-1:], decode)

    return tokens()


def butter_tokens(network, kind, prompt: mx.array, decode: int, prefill_chunk: int | None = None) -> Iterator:
    """``Generation`` (the loop of ``butter generate``) for one prompt, as a stream of its tokens."""
    engine = Engine(network, LoadOptions(kv_cache=kind, max_context_length=prompt.size + decode + 8), prefill_chunk=prefill_chunk)
    return iter(Generation(engine, prompt, engine.make_layer_caches(), max_tokens=decode))


def timed_run(tokens: Iterator, prompt_tokens: int) -> dict:
    """One stream read to its end: ``run_stats`` of the times its tokens arrived, and the peak memory since its start."""
    mx.synchronize()
    mx.reset_peak_memory()
    start = time.perf_counter()
    times = [time.perf_counter() - start for _ in tokens]
    return run_stats(prompt_tokens, times) | {"peak_gib": mx.get_peak_memory() / 2**30}


def run_stats(prompt_tokens: int, times: list[float]) -> dict:
    """A run's rates from the times (since its start) at which each token arrived: prefill
    tok/s, decode tok/s (tokens after the first over the time after it), its first and its
    slowest decode step (a step that compiles a kernel shows there)."""
    steps = [b - a for a, b in zip(times, times[1:])]
    return {"prefill_tok_s": prompt_tokens / times[0], "first_step_s": steps[0], "slowest_step_s": max(steps),
            "decode_tok_s": len(steps) / (times[-1] - times[0])}  # fmt: skip


def butter_warm_up(network, kind, context: int, prefill_chunk: int | None = None) -> None:
    """What ``butter serve`` does before it listens: ``warm_up`` for generations of up to ``context`` positions."""
    warm_up(Engine(network, LoadOptions(kv_cache=kind, max_context_length=context), prefill_chunk=prefill_chunk))


def e2e_section(args, config: dict) -> None:
    decode = max(args.decode_tokens, args.interleave_tokens if args.interleave else 0)
    config = config | {"max_position_embeddings": max(config["max_position_embeddings"], max(args.e2e_context) + decode + 64)}
    network = build_model(config, Path("qwen3-shaped (random weights)"))
    network.set_dtype(mx.bfloat16)
    mx.eval(network.parameters())
    qwen3 = mlx_lm_module("models.qwen3")
    reference = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    fuse_projections(network)  # as butter's engine does, so that mlx-lm's model shares its (viewed) weights
    reference.load_weights(tree_flatten(network.parameters()))
    mx.eval(reference.parameters())
    streams, warm_ups = {}, {}
    if not args.no_mlx_lm:
        streams["mlx-lm raw"] = lambda p, decode: mlx_lm_tokens(reference, p, decode)
        # Before timing, what a server does before it listens: mlx-lm has no warm-up, so one short run of its own,
        # never of the timed prompt's length (butter's warm-up prompt is not that length either, and a first prompt
        # of a new length pays MLX's per-shape setup on a GPU, which a warm-up of that very length would hide).
        warm_ups["mlx-lm raw"] = lambda c: timed_run(
            mlx_lm_tokens(reference, mx.arange(min(4096, c - 64), dtype=mx.uint32), 48), 0)
    for name, chunk in itertools.product(args.kv_cache, args.prefill_chunk or [None]):
        kind, label = parse_kv_cache(name), f"butter {name}" + (f" @{chunk}" if chunk else "")
        streams[label] = lambda p, decode, kind=kind, chunk=chunk: butter_tokens(network, kind, p, decode, chunk)
        warm_ups[label] = lambda c, kind=kind, chunk=chunk: butter_warm_up(network, kind, c + decode + 8, chunk)
    warmed = "no warm-up" if args.no_warm_up else "each engine warmed up first"
    print(f"\n## End to end: {config['num_hidden_layers']} layers, hidden {config['hidden_size']}, random bf16; "
          f"{args.decode_tokens} greedy tokens; {warmed}; medians of {args.rounds} rounds (first step: the first "
          "round's / the median; slowest step: of all rounds)\n")  # fmt: skip
    print("| context | engine | warm-up s | prefill tok/s | prefill / mlx-lm | decode tok/s | decode / butter raw "
          "| decode / mlx-lm raw | first step s | slowest step s | peak GiB |")  # fmt: skip
    print("|---:|---|---:|---:|---:|---:|---:|---:|---|---:|---:|")
    interleaved = {}
    for context in args.e2e_context:
        prompt = mx.random.randint(0, config["vocab_size"], (context,), key=mx.random.key(context)).astype(mx.uint32)
        warm_seconds = {}
        for name, warm in ({} if args.no_warm_up else warm_ups).items():
            start = time.perf_counter()
            warm(context)
            warm_seconds[name] = time.perf_counter() - start
            mx.clear_cache()
        runs = {name: [] for name in streams}
        names = list(streams)
        for round_ in range(args.rounds):
            for name in names[round_ % len(names):] + names[: round_ % len(names)]:
                try:
                    runs[name].append(timed_run(streams[name](prompt, args.decode_tokens), context))
                except Exception as exc:  # noqa: BLE001
                    runs[name].append({"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"})
                    traceback.print_exc()
                mx.clear_cache()
        medians = {}
        for name, rs in runs.items():
            ok = [r for r in rs if "error" not in r]
            if ok:
                medians[name] = {key: statistics.median(r[key] for r in ok) for key in ok[0]} | {
                    "first": rs[0].get("first_step_s"), "slowest": max(r["slowest_step_s"] for r in ok)}
        for name, rs in runs.items():
            if name not in medians:
                print(f"| {context} | {name} | {rs[0]['error']} |||||||||")
                continue
            m = medians[name]
            ratio = lambda other, rate="decode_tok_s": f"{m[rate] / medians[other][rate]:.2f}x" if other in medians else ""  # noqa: E731
            first = f"{m['first']:.3f} / {m['first_step_s']:.3f}" if m["first"] is not None else f"- / {m['first_step_s']:.3f}"
            warm = f"{warm_seconds[name]:.2f}" if name in warm_seconds else "-"
            print(f"| {context} | {name} | {warm} | {m['prefill_tok_s']:.0f} | {ratio('mlx-lm raw', 'prefill_tok_s')} | "
                  f"{m['decode_tok_s']:.1f} | {ratio('butter raw')} | "
                  f"{ratio('mlx-lm raw')} | {first} | {m['slowest']:.3f} | {m['peak_gib']:.1f} |", flush=True)  # fmt: skip
        if args.interleave:
            turns = {name: make(prompt, args.interleave_tokens) for name, make in streams.items()}
            interleaved[context] = interleaved_turns(turns, args.interleave)
            del turns
            mx.clear_cache()
    if args.interleave:
        print(f"\n## End to end, interleaved: the engines decode in turns of {args.interleave} tokens over one prompt each, "
              f"{args.interleave_tokens} tokens each (`interleaved_turns`); rates over all turns, ratios over the turns "
              "the engines shared (in brackets the quartiles of the ratios turn by turn)\n")  # fmt: skip
        print("| context | engine | turns | decode tok/s | / butter raw | / mlx-lm raw |")
        print("|---:|---|---:|---:|---:|---:|")
        for context, seconds in interleaved.items():
            interleaved_table(context, seconds, args.interleave)


def interleaved_turns(streams: dict[str, Iterator], every: int) -> dict[str, list[float]]:
    """Each stream's turns of ``every`` tokens, the streams taking turns (order rotating each turn)
    over one process's seconds, so that a drift of the host's speed (tens of percent between
    processes on the lent machines) falls on every engine alike: per stream, each turn's seconds
    from its first token to its last (``every - 1`` steps, as ``run_stats``' decode rate counts).
    Each stream's prefill and first token come first, untimed. A turn starts with the device idle
    and its stream's next step already queued, as any pipelined step is."""
    for tokens in streams.values():
        next(tokens)
    seconds = {name: [] for name in streams}
    names = list(streams)
    for turn in itertools.count():
        for name in names[turn % len(names) :] + names[: turn % len(names)]:
            mx.synchronize()
            times = [time.perf_counter() for _ in itertools.islice(streams[name], every)]
            if len(times) < every:
                return seconds
            seconds[name].append(times[-1] - times[0])


def interleaved_table(context: int, seconds: dict[str, list[float]], every: int) -> None:
    """Each engine's decode rate over all its turns (work done every few steps, such as AURA's
    deferred encode, counts in full), its ratio to butter raw's and to mlx-lm's over the turns
    they shared, and the quartiles of those ratios turn by turn."""

    def ratio(name, other):
        if other not in seconds:
            return ""
        pairs = list(zip(seconds[name], seconds[other]))
        whole = sum(b for _, b in pairs) / sum(a for a, _ in pairs)
        turns = [b / a for a, b in pairs]
        low, _, high = statistics.quantiles(turns, n=4) if len(turns) > 1 else turns * 3
        return f"{whole:.2f}x ({low:.2f}-{high:.2f})"

    for name, values in seconds.items():
        print(f"| {context} | {name} | {len(values)} | {len(values) * (every - 1) / sum(values):.1f} | "
              f"{ratio(name, 'butter raw')} | {ratio(name, 'mlx-lm raw')} |", flush=True)  # fmt: skip


def latency_section(args) -> None:
    from butter_core.model import Model
    from long_prefill import write_model

    if not (args.model_dir / "model.safetensors").exists():
        write_model(args.model_dir, "small" if args.small else "qwen3-1.7b", "bfloat16", 40960)
    warm = "no warm-up" if args.no_warm_up else f"after warm_up(engine, 4096 + {LATENCY_TOKENS})"
    print(f"\n## Latency after Model.load ({warm}): 4096-token prompt, {LATENCY_TOKENS} greedy tokens\n")
    print("| scheme | load s | warm-up s | first token s | first step ms | steady step ms | first / steady | slowest step ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.kv_cache:
        start = time.perf_counter()
        model = Model.load(args.model_dir, LoadOptions(kv_cache=parse_kv_cache(name)))
        loaded = time.perf_counter()
        warmed = loaded if args.no_warm_up else loaded + warm_up(model.engine, 4096 + LATENCY_TOKENS).seconds
        prompt = mx.random.randint(0, model.network.args.vocab_size, (4096,), key=mx.random.key(1)).astype(mx.uint32)
        caches = model.engine.make_layer_caches()
        times = [time.perf_counter()]
        for _ in Generation(model.engine, prompt, caches, max_tokens=LATENCY_TOKENS):
            times.append(time.perf_counter())
        steps = [b - a for a, b in zip(times[1:], times[2:])]
        steady = statistics.median(steps[2:])
        print(f"| {name} | {loaded - start:.2f} | {warmed - loaded:.2f} | {times[1] - times[0]:.2f} | {1e3 * steps[0]:.1f} | "
              f"{1e3 * steady:.1f} | {steps[0] / steady:.1f}x | {1e3 * max(steps):.1f} |", flush=True)  # fmt: skip
        del model, caches
        mx.clear_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, nargs="+", default=[4096, 32768, 131072])
    parser.add_argument("--e2e-context", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--kv-cache", type=lambda t: t.split(","), default=["raw", "affine4", "aura4v2"])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--interleave", type=int, default=8, metavar="TOKENS",
                        help="end to end, also decode with the engines taking turns of this many tokens (0: not)")
    parser.add_argument("--no-mlx-lm", action="store_true", help="end to end, butter's schemes alone (less memory at 128k)")
    parser.add_argument("--interleave-tokens", type=int, default=256, help="each engine's tokens when interleaved")
    parser.add_argument("--prefill-chunk", type=int, nargs="+",
                        help="end to end, each butter scheme at each of these prefill chunks (default: the engine's)")
    parser.add_argument("--skip-layers", action="store_true")
    parser.add_argument("--skip-e2e", action="store_true")
    parser.add_argument("--small", action="store_true", help="small heads, layers and model: a CPU check of the script")
    parser.add_argument("--latency", action="store_true")
    parser.add_argument("--no-warm-up", action="store_true",
                        help="time without warming up first (butter_core.warm_up, mlx-lm's short run)")
    parser.add_argument("--profile", type=lambda t: t.split(","), default=[], metavar="PATH,...",
                        help="per layer, also print a cProfile of these paths' builds (e.g. 'butter raw,butter affine4')")
    parser.add_argument("--profile-lines", type=int, default=25)
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/butter-decode-step-model"))
    args = parser.parse_args()
    print(f"MLX {mx.__version__}, {mx.default_device()}, {mx.device_info().get('device_name', '')}, {time.strftime('%Y-%m-%d')}")
    if mx.cuda.is_available():
        from butter_core.kernels import cuda_binaries

        print("butter's CUDA kernels:", "compiled once per install (cuda_binaries)" if cuda_binaries.available()
              else "compiled in each process (mx.fast.cuda_kernel)")
    if args.latency:
        return latency_section(args)
    if not args.skip_layers:
        layers_section(args, *((4, 2, 64) if args.small else (32, 8, 128)))
    if not args.skip_e2e:
        e2e_section(args, SMALL_MODEL if args.small else QWEN3_1_7B)


if __name__ == "__main__":
    main()
