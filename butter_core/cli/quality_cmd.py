"""``butter quality``: perplexity, KL and top-1 agreement against raw, and a copy probe, per scheme and text.

Teacher-forced through the caches in chunks (see ``butter_core.quality``); a progress
bar on stderr, a Markdown table on stdout, ``--json`` for the stable keys below.
Without ``--text`` it reads the two texts shipped in ``butter_core.data`` (code and prose).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from butter_core.benchmark import METADATA_KEYS, check_output_path, parse_scheme_list, run_metadata, write_json
from butter_core.cli.bench_cmd import add_model_and_schemes, keys_epilog
from butter_core.cli.model_options import positive_int
from butter_core.data import DEFAULT_TEXTS
from butter_core.default_model import DEFAULT_MODEL_NAME
from butter_core.errors import ConfigError
from butter_core.model import Model
from butter_core.quality import (
    CHUNK_TOKENS,
    COPY_OFFSET,
    COPY_SEED,
    COPY_SPAN,
    DEFAULT_CONTEXT,
    PREFILL_TOKENS,
    QUALITY_KEYS,
    format_quality_table,
    load_text,
    run_quality,
)


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "quality",
        help="compare cache schemes' next-token predictions with raw's on real text",
        description="Teacher-forced over each text's first N tokens, fed through the caches in chunks: "
        "perplexity, KL(raw || scheme), top-1 agreement with raw, and a long-range copy probe.",
        epilog=keys_epilog("JSON: {\"metadata\": {...}, \"results\": [...]}; each result has", QUALITY_KEYS)
        + "\n\n" + keys_epilog("metadata (plus the run's settings)", METADATA_KEYS),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_and_schemes(parser, "each is compared with a separate raw run")
    parser.add_argument(
        "--text", nargs="+", metavar="FILE",
        help="UTF-8 text files (default: the shipped textwrap.py.txt and gpl-3.0.txt)",
    )  # fmt: skip
    parser.add_argument(
        "--context", type=positive_int, default=DEFAULT_CONTEXT, metavar="N",
        help=f"tokens of each text to evaluate (default {DEFAULT_CONTEXT})",
    )  # fmt: skip
    parser.add_argument(
        "--prefill", type=positive_int, default=PREFILL_TOKENS, metavar="N",
        help=f"tokens of the first chunk (default {PREFILL_TOKENS})",
    )  # fmt: skip
    parser.add_argument(
        "--chunk", type=positive_int, default=CHUNK_TOKENS, metavar="N",
        help=f"tokens of each later chunk fed through the caches (default {CHUNK_TOKENS})",
    )  # fmt: skip
    parser.add_argument("--json", metavar="PATH", help="write the results and run metadata as JSON")
    parser.set_defaults(run=run)


def run(args) -> int:
    kinds = parse_scheme_list(args.kv_cache)
    check_output_path(args.json, "--json")
    sources = [(Path(path), None) for path in args.text] if args.text else [(path, path.name) for path in DEFAULT_TEXTS]
    for path, _ in sources:  # before loading the model
        if not path.is_file():
            raise ConfigError(f"--text {path}: {'is a directory' if path.is_dir() else 'no such file'}")
    model = Model.load(args.model, progress_stream=sys.stderr)
    texts = [load_text(path, model.tokenizer, args.context, name=name) for path, name in sources]
    results = run_quality(model, kinds, texts, prefill=args.prefill, chunk=args.chunk, progress_stream=sys.stderr)
    print(format_quality_table(results))
    if args.json:
        settings = {"context": args.context, "prefill": args.prefill, "chunk": args.chunk,
                    "copy_span": COPY_SPAN, "copy_offset": COPY_OFFSET, "copy_seed": COPY_SEED}  # fmt: skip
        write_json(args.json, run_metadata(args.model or DEFAULT_MODEL_NAME, **settings), [r.as_dict() for r in results])
    return 0
