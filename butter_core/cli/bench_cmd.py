"""``butter bench``: KV bytes, peak memory, prefill and decode tok/s per scheme and context.

A progress bar on stderr while it runs, a Markdown table on stdout at the end,
``--json`` for the stable keys below, ``--plot`` for a PNG (needs the ``plot`` extra).
The measuring is ``butter_core.benchmark``.
"""

from __future__ import annotations

import argparse
import sys

from butter_core.benchmark import (
    BENCH_KEYS,
    DEFAULT_CONTEXTS,
    DEFAULT_DECODE_TOKENS,
    METADATA_KEYS,
    check_output_path,
    format_bench_table,
    parse_scheme_list,
    require_matplotlib,
    run_bench,
    run_metadata,
    write_json,
    write_plot,
)
from butter_core.cli.model_options import add_model_argument, positive_int
from butter_core.default_model import DEFAULT_MODEL_NAME
from butter_core.model import Model


def add_model_and_schemes(parser: argparse.ArgumentParser, raw_note: str) -> None:
    """``-m/--model`` and a comma-separated ``--kv-cache`` list (shared with ``butter quality``)."""
    add_model_argument(parser)
    parser.add_argument(
        "--kv-cache", default="raw", metavar="SCHEME,...",
        help=f"comma-separated KV cache schemes (see `butter plugins`), e.g. raw,affine8 (default raw); {raw_note}",
    )  # fmt: skip


def positive_int_list(text: str) -> list[int]:
    """argparse type: ``512,1024,2048``."""
    return [positive_int(part.strip()) for part in text.split(",")]


def keys_epilog(title: str, keys: dict[str, str]) -> str:
    """Help text listing JSON keys and their meaning."""
    return "\n".join([f"{title}:", *(f"  {key:<20} {meaning}" for key, meaning in keys.items())])


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "bench",
        help="measure KV memory and speed per cache scheme and context length",
        description="Per scheme and context: KV bytes, peak memory, prefill and decode tok/s, "
        "schemes interleaved per context; raw is the baseline of every ratio.",
        epilog=keys_epilog("JSON: {\"metadata\": {...}, \"results\": [...]}; each result has", BENCH_KEYS)
        + "\n\n" + keys_epilog("metadata (plus the settings contexts, decode_tokens, repeats)", METADATA_KEYS),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_and_schemes(parser, "raw is always measured, as the baseline")
    parser.add_argument(
        "--context", type=positive_int_list, default=list(DEFAULT_CONTEXTS), metavar="N,N,...",
        help="prompt lengths in tokens (default 512,1024,2048)",
    )  # fmt: skip
    parser.add_argument(
        "--decode-tokens", type=positive_int, default=DEFAULT_DECODE_TOKENS, metavar="N",
        help=f"greedy tokens decoded after each prompt, at least 2 (default {DEFAULT_DECODE_TOKENS})",
    )  # fmt: skip
    parser.add_argument(
        "--repeats", type=positive_int, default=1, metavar="R",
        help="rounds per context, every scheme once per round; tok/s are medians (default 1)",
    )  # fmt: skip
    parser.add_argument(
        "--batch", type=positive_int_list, metavar="B,B,...",
        help="generate B sequences together for each B (continuous batching over paged caches), e.g. 1,8,32; "
        "decode tok/s is then the batch's aggregate (default: one sequence at a time)",
    )  # fmt: skip
    parser.add_argument("--json", metavar="PATH", help="write the results and run metadata as JSON")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG of memory and tok/s against context (needs matplotlib)")
    parser.set_defaults(run=run)


def run(args) -> int:
    kinds = parse_scheme_list(args.kv_cache)
    check_output_path(args.json, "--json")
    check_output_path(args.plot, "--plot")
    if args.plot:
        require_matplotlib()
    model = Model.load(args.model, progress_stream=sys.stderr)
    results = run_bench(
        model, kinds, args.context, args.decode_tokens, repeats=args.repeats, batches=args.batch,
        progress_stream=sys.stderr,
    )  # fmt: skip
    settings = {"contexts": args.context, "decode_tokens": args.decode_tokens, "repeats": args.repeats,
                "batches": args.batch}  # fmt: skip
    metadata = run_metadata(args.model or DEFAULT_MODEL_NAME, **settings)
    print(format_bench_table(results))
    if args.json:
        write_json(args.json, metadata, [result.as_dict() for result in results])
    if args.plot:
        write_plot(results, metadata, args.plot)
    return 0
