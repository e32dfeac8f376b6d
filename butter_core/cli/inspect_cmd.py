"""``butter inspect``: a model's shape, weights and per-layer KV caches; ``--layer-trace`` times one forward."""

from __future__ import annotations

from butter_core.cli.model_options import add_model_arguments, load_model
from butter_core.cpu_blas import LOADED_BLAS
from butter_core.engine import cache_windows
from butter_core.generation import format_bytes

TRACE_PROMPT = "The quick brown fox jumps over the lazy dog."


def add_parser(sub) -> None:
    parser = sub.add_parser("inspect", help="show a model's layers and KV caches; --layer-trace times a forward pass")
    add_model_arguments(parser)
    parser.add_argument("--layer-trace", action="store_true", help="run one forward pass and time each layer")
    parser.add_argument("-p", "--prompt", default=TRACE_PROMPT, help="text the layer trace runs (default: a pangram)")
    parser.set_defaults(run=run)


def run(args) -> int:
    model = load_model(args)
    a = model.network.args
    print(f"model: {model.path}")
    print(
        f"family {a.model_type}: {a.num_hidden_layers} layers, hidden {a.hidden_size}, "
        f"{a.num_attention_heads} heads ({a.num_key_value_heads} KV) of {a.head_dim}, vocab {a.vocab_size}, "
        f"max_position_embeddings {a.max_position_embeddings}"
    )
    print(f"weights: {model.weights}; BLAS: {LOADED_BLAS or 'bundled with MLX'}")
    caches = model.engine.make_layer_caches()
    if args.layer_trace:
        ids = model.tokenizer.encode(args.prompt)
        print(f"layer trace: one forward of {len(ids)} tokens")
        for timing in model.engine.layer_trace(ids, caches):
            print(f"  layer {timing.layer_index:>3}  {timing.seconds * 1e3:8.2f} ms  output {list(timing.output_shape)}")
    scheme = str(model.options.kv_cache)
    print(f"{'layer':>5}  {'scheme':<10} {'window':<28} {'K/V shape':<20} {'dtype':<9} {'allocated':>10} {'live':>10}")
    for cache, window in zip(caches, cache_windows(caches)):
        s = cache.spec
        shape = str([s.batch_size, s.n_kv_heads, s.max_positions, s.head_dim])
        print(
            f"{s.layer_index:>5}  {scheme:<10} {str(window or '-'):<28} {shape:<20} {str(s.dtype).removeprefix('mlx.core.'):<9} "
            f"{format_bytes(cache.nbytes_allocated):>10} {format_bytes(cache.nbytes_live):>10}"
        )
    total_allocated = sum(c.nbytes_allocated for c in caches)
    total_live = sum(c.nbytes_live for c in caches)
    print(f"total: {format_bytes(total_allocated)} allocated, {format_bytes(total_live)} live")
    return 0

