"""``butter serve``: an OpenAI-compatible HTTP server over continuous batching (``butter_core.serving``)."""

from __future__ import annotations

import sys

from butter_core.cli.model_options import add_model_arguments, load_model, non_negative_int, positive_int
from butter_core.distributed import world
from butter_core.serving.server import KV_MEMORY_FRACTION, PREFIX_CACHE_FRACTION, serve


def add_parser(sub) -> None:
    parser = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    add_model_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=non_negative_int, default=8080, help="port to listen on (default 8080)")
    parser.add_argument("--max-sessions", type=positive_int, default=8, metavar="N",
                        help="requests generating at once; the others wait in FIFO order (default 8)")  # fmt: skip
    parser.add_argument("--max-queue", type=non_negative_int, default=64, metavar="N",
                        help="requests that may wait; one more is answered 429 (default 64)")  # fmt: skip
    parser.add_argument("--kv-memory", type=positive_int, metavar="BYTES",
                        help=f"bytes of KV cache pages, allocated at start (default {KV_MEMORY_FRACTION * 100:.0f}%% of the "
                             "device's memory, at most what --max-sessions whole contexts use)")  # fmt: skip
    parser.add_argument("--prefix-cache-bytes", type=non_negative_int, metavar="BYTES",
                        help=f"bytes of prompts kept across requests, in the scheme's encoded form, least recently "
                             f"used evicted; 0 turns reuse off (default {PREFIX_CACHE_FRACTION * 100:.0f}%% of --kv-memory)")  # fmt: skip
    parser.add_argument("--max-tokens", type=positive_int, default=512, metavar="N",
                        help="a chat request's max_tokens when it gives none (default 512)")  # fmt: skip
    parser.add_argument("--no-warm-up", dest="warm_up", action="store_false",
                        help="skip compiling the batched prefill and decode kernels before serving (then the first "
                             "requests pay it)")  # fmt: skip
    parser.set_defaults(run=run)


def run(args) -> int:
    model = load_model(args)
    model_id = args.model or "default"
    group = world()
    if group.rank() == 0:
        ranks = f", tensor parallel over {group.size()} ranks" if group.size() > 1 else ""
        print(f"butter serve: {model_id} on http://{args.host}:{args.port}/v1 (kv cache {args.kv_cache}{ranks})",
              file=sys.stderr)  # fmt: skip
    serve(model, host=args.host, port=args.port, kv_memory=args.kv_memory, max_sessions=args.max_sessions,
          max_queue=args.max_queue, default_max_tokens=args.max_tokens, model_id=model_id,
          prefix_cache_bytes=args.prefix_cache_bytes, warm_up=args.warm_up)  # fmt: skip
    return 0
