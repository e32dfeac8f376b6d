"""``butter inspect``: a model's shape, weights and per-layer KV caches; ``--layer-trace`` times one forward."""

from __future__ import annotations

from butter_core.cache import LayerSpec
from butter_core.cli.model_options import add_model_arguments, load_model
from butter_core.cpu_blas import LOADED_BLAS
from butter_core.distributed import total_bytes, world
from butter_core.engine import cache_windows
from butter_core.generation import format_bytes
from butter_core.layer_caches import layer_kinds

TRACE_PROMPT = "The quick brown fox jumps over the lazy dog."


def add_parser(sub) -> None:
    parser = sub.add_parser("inspect", help="show a model's layers and KV caches; --layer-trace times a forward pass")
    add_model_arguments(parser)
    parser.add_argument("--layer-trace", action="store_true", help="run one forward pass and time each layer")
    parser.add_argument("-p", "--prompt", default=TRACE_PROMPT, help="text the layer trace runs (default: a pangram)")
    parser.set_defaults(run=run)


def run(args) -> int:
    model = load_model(args)
    print(f"model: {model.path}")
    print(model.network.describe())
    print(f"weights: {model.weights}; BLAS: {LOADED_BLAS or 'bundled with MLX'}")
    caches = model.engine.make_layer_caches()
    if args.layer_trace:
        ids = model.tokenizer.encode(args.prompt)
        print(f"layer trace: one forward of {len(ids)} tokens")
        along = model.network.along_layers(caches)
        for timing in model.engine.layer_trace(ids, caches):
            cache = along[timing.layer_index]
            held = ("none", "-") if cache is None else (cache.spec.layer_type, format_bytes(cache.nbytes_live))
            print(f"  layer {timing.layer_index:>3}  {held[0]:<11} {timing.seconds * 1e3:8.2f} ms  "
                  f"output {list(timing.output_shape)}  cache {held[1]}")  # fmt: skip
    print(f"{'layer':>5}  {'type':<11} {'scheme':<12} {'window':<28} {'shape':<24} {'dtype':<9} {'allocated':>10} {'live':>10}")
    kinds = layer_kinds(model.options)
    for cache, window in zip(caches, cache_windows(caches)):
        s = cache.spec
        if isinstance(s, LayerSpec):
            shape = f"K/V {[s.batch_size, s.n_kv_heads, s.max_positions, s.head_dim]}"
        else:
            shape = f"state {[s.batch_size, *s.state_shape]}"
        print(
            f"{s.layer_index:>5}  {s.layer_type:<11} {str(kinds(s.layer_type)):<12} {str(window or '-'):<28} {shape:<24} "
            f"{str(s.dtype).removeprefix('mlx.core.'):<9} {format_bytes(cache.nbytes_allocated):>10} "
            f"{format_bytes(cache.nbytes_live):>10}"
        )
    total_allocated = sum(c.nbytes_allocated for c in caches)
    total_live = sum(c.nbytes_live for c in caches)
    print(f"total: {format_bytes(total_allocated)} allocated, {format_bytes(total_live)} live")
    group = world()
    if group.size() > 1:
        every_allocated, every_live = total_bytes(total_allocated, group), total_bytes(total_live, group)
        print(f"tensor parallel: rank {group.rank()} of {group.size()} above (its heads' share); all ranks: "
              f"{format_bytes(every_allocated)} allocated, {format_bytes(every_live)} live")  # fmt: skip
    return 0
