"""``butter generate``: stream a completion to stdout, then one summary line to stderr."""

from __future__ import annotations

import functools
import io
import sys

from butter_core.cli.model_options import add_model_arguments, load_model, positive_int, prompt_text
from butter_core.distributed import shared_seed, total_bytes, world
from butter_core.errors import ConfigError
from butter_core.generation import format_bytes
from butter_core.progress import Progress
from butter_core.prompt_cache import rank_file, resume_prompt_cache, save_prompt_cache
from butter_core.sampling import Sampler
from butter_core.warm_up import warm_up

PROGRESS_DELAY = 2.0
"""Seconds a prefill runs before its progress shows on stderr."""


def add_parser(sub) -> None:
    parser = sub.add_parser("generate", help="generate text from a prompt, streamed to stdout")
    add_model_arguments(parser)
    parser.add_argument("-p", "--prompt", required=True, type=prompt_text, help="the prompt text")
    parser.add_argument("--max-tokens", type=positive_int, default=256, metavar="N", help="stop after N tokens (default 256)")
    parser.add_argument("--temp", type=float, default=0.0, metavar="T", help="sampling temperature; 0 is greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass in (0, 1] (default 1)")
    parser.add_argument("--seed", type=int, metavar="S", help="random seed, for reproducible sampling")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="do not stop at the model's end-of-sequence tokens: generate exactly --max-tokens")  # fmt: skip
    parser.add_argument("--prompt-cache", metavar="FILE",
                        help="reuse the prompt prefix FILE holds (if it exists, for this model and --kv-cache), "
                             "then save this prompt's cache to FILE (safetensors)")  # fmt: skip
    parser.add_argument("--warm-up", action="store_true",
                        help="compile the kernels this generation runs before it starts (butter_core.warm_up), so "
                             "the first token and decode step are timed without compilation")  # fmt: skip
    parser.set_defaults(run=run)


def _save(path: str, model, prompt: list[int], held: int, err, caches) -> None:
    save_prompt_cache(rank_file(path, model), model, caches, prompt)
    print(f"prompt cache: {held} of {len(prompt)} prompt tokens reused; saved {len(prompt)} to {path}", file=err)


def run(args) -> int:
    if not args.prompt:
        raise ConfigError("-p/--prompt is empty: give the text to generate from")
    group = world()
    sampler = Sampler(args.temp, args.top_p, shared_seed(args.seed, group))
    model = load_model(args)
    shown = group.rank() == 0  # under tensor parallelism every rank generates the same tokens; one prints them
    out, err = (sys.stdout, sys.stderr) if shown else (io.StringIO(), io.StringIO())
    prompt = model.encode_prompt(args.prompt, chat=args.chat)
    caches, held, prefilled = None, 0, None
    if args.prompt_cache:
        caches, held = resume_prompt_cache(args.prompt_cache, model, prompt)
        prefilled = functools.partial(_save, args.prompt_cache, model, prompt, held, err)
    prefill = Progress(len(prompt) - held, "prefill", err, delay=PROGRESS_DELAY)
    generation = model.generate(
        prompt[held:], caches, sampler=sampler, max_tokens=args.max_tokens, stop_ids=() if args.ignore_eos else None,
        prefill_progress=lambda done, total: prefill.advance_to(done, "tokens"), prefilled=prefilled,
    )  # fmt: skip
    if args.warm_up:  # after the request is checked (model.generate), before its first token
        print(f"warm-up: {warm_up(model.engine, len(prompt) + args.max_tokens).seconds:.2f} s", file=err)
    detokenizer = model.tokenizer.detokenizer()
    for token_id in generation:
        prefill.finish()
        out.write(detokenizer.add(token_id))
        out.flush()
    prefill.finish()
    out.write(detokenizer.flush() + "\n")
    stats = generation.stats
    print(stats.summary(), file=err)
    if group.size() > 1:
        allocated, live = total_bytes(stats.kv_bytes_allocated, group), total_bytes(stats.kv_bytes_live, group)
        print(f"tensor parallel: {group.size()} ranks, KV bytes above per rank; all ranks: {format_bytes(allocated)} "
              f"allocated, {format_bytes(live)} live", file=err)  # fmt: skip
    return 0
