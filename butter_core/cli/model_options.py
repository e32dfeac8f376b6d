"""Flags shared by the commands that load a model, and turning them into ``LoadOptions``.

``-m/--model``, ``--kv-cache``, ``--state-cache``, ``--kv-window-size``/``--kv-window-keep``,
``--max-context`` and ``--prefill-chunk``. Every invalid value raises a ``ButterError`` naming its flag, which
``butter_core.cli.main`` reports in one line with exit code 2.
"""

from __future__ import annotations

import argparse
import sys

from butter_core import parse_kv_cache
from butter_core.config import LoadOptions, Window
from butter_core.errors import ButterError, ConfigError
from butter_core.model import Model


def positive_int(text: str) -> int:
    """argparse type: an integer > 0."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return value


def prompt_text(text: str) -> str:
    """argparse type: text that is valid UTF-8 (a command line can carry other bytes, which
    Python keeps as lone surrogates that no tokenizer can encode)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        byte = ord(text[exc.start]) - 0xDC00 if 0xDC80 <= ord(text[exc.start]) <= 0xDCFF else None
        what = f"byte 0x{byte:02x}" if byte is not None else repr(text[exc.start])
        raise argparse.ArgumentTypeError(f"not valid UTF-8 ({what} at character {exc.start})") from None
    return text


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``-m/--model`` (every command that loads a model has it)."""
    parser.add_argument(
        "-m", "--model", help="model directory, .gguf file or Hugging Face repo id (default: SmolLM2-135M-Instruct)"
    )


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the model and KV cache flags to ``parser``."""
    add_model_argument(parser)
    parser.add_argument("--kv-cache", default="raw", metavar="SCHEME", help="KV cache scheme (see `butter plugins`); default raw")
    parser.add_argument("--state-cache", metavar="SCHEME",
                        help="cache scheme of recurrent (Mamba2, gated delta) layers; default ssm (butter-ssm)")  # fmt: skip
    parser.add_argument("--kv-window-size", type=positive_int, metavar="N", help="sliding-window eviction: keep at most N positions per layer")
    parser.add_argument("--kv-window-keep", type=non_negative_int, metavar="K", help="sink positions the window never evicts (default 4)")
    parser.add_argument("--max-context", type=positive_int, metavar="N", help="cap full-attention layers' cache at N positions")
    parser.add_argument("--prefill-chunk", type=positive_int, metavar="N",
                        help="prompt tokens per forward pass during prefill (default: 8192 on a CUDA GPU of 64 GiB "
                             "or more, 2048 on other GPUs, 512 on a CPU)")  # fmt: skip


def load_options(args: argparse.Namespace) -> LoadOptions:
    """The ``LoadOptions`` the flags describe."""
    kind = parse_kv_cache(args.kv_cache)
    eviction = None
    if args.kv_window_size is None:
        if args.kv_window_keep is not None:
            raise ConfigError("--kv-window-keep needs --kv-window-size")
    else:
        keep = {} if args.kv_window_keep is None else {"keep": args.kv_window_keep}
        try:
            eviction = Window(max_size=args.kv_window_size, **keep)
        except ConfigError as exc:
            raise ConfigError(f"--kv-window-size/--kv-window-keep: {exc}") from exc
    state = None if args.state_cache is None else _state_cache(args.state_cache)
    return LoadOptions(kv_cache=kind, kv_eviction=eviction, max_context_length=args.max_context, state_cache=state,
                       prefill_chunk=args.prefill_chunk)  # fmt: skip


def _state_cache(text: str):
    try:
        return parse_kv_cache(text)
    except ButterError as exc:
        raise type(exc)(f"--state-cache: {exc}") from exc


def load_model(args: argparse.Namespace) -> Model:
    """Load ``--model`` with the options the flags describe (a first conversion's progress on stderr)."""
    return Model.load(args.model, load_options(args), progress_stream=sys.stderr)
