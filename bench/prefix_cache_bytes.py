"""Bytes of one kept prompt per scheme: the prefix cache's snapshot and the prompt-cache file.

For each ``--kv-cache`` scheme the model (default: the built-in one) prefills the same prompt of
``--tokens`` tokens through batched caches, and the sequence is copied out as the prefix cache
keeps it (``BatchedCaches.export_sequence``); the same prompt through single caches is saved
with ``save_prompt_cache``. Reported per scheme: snapshot bytes, file bytes, how many such
prompts a 1 GiB prefix cache keeps, and both ratios against the first scheme listed.

Usage::

    python bench/prefix_cache_bytes.py [--kv-cache raw-bfloat16,raw,affine4,aura4v2] [--tokens 2048] [--model M]
"""

from __future__ import annotations

import argparse
import os
import tempfile

import butter_core  # noqa: F401 - before mlx.core (CPU BLAS)
import mlx.core as mx

from butter_core import LoadOptions
from butter_core.model import Model
from butter_core.prompt_cache import save_prompt_cache

GIB = 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kv-cache", default="raw-bfloat16,raw,affine4,aura4v2")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--model")
    args = parser.parse_args()
    rows = []
    for scheme in args.kv_cache.split(","):
        model = Model.load(args.model, LoadOptions(kv_cache=scheme))
        words = ("the quick brown fox jumps over the lazy dog " * args.tokens).split()
        prompt = model.encode_prompt(" ".join(words))[: args.tokens]
        caches = model.engine.make_batched_caches(capacity_tokens=args.tokens + 64, max_sequences=1)
        handle = caches.open()
        caches.reserve(handle, len(prompt))
        for start in range(0, len(prompt), model.engine.prefill_chunk):
            chunk = mx.array(prompt[start : start + model.engine.prefill_chunk], dtype=mx.uint32)[None]
            mx.eval(model.engine.run_batched(chunk, caches, [handle]))
        snapshot = caches.export_sequence(handle).nbytes
        single = model.engine.make_layer_caches()
        mx.eval(model.engine.forward(prompt, single))
        with tempfile.TemporaryDirectory() as directory:
            path = os.path.join(directory, "prompt.safetensors")
            save_prompt_cache(path, model, single, prompt)
            file_bytes = os.path.getsize(path)
        rows.append((scheme, snapshot, file_bytes))
    base = rows[0]
    print(f"| scheme | snapshot bytes ({args.tokens} tokens) | prompts per GiB | {base[0]} / this | file bytes | "
          f"{base[0]} / this |")
    print("|---|---|---|---|---|---|")
    for scheme, snapshot, file_bytes in rows:
        print(f"| {scheme} | {snapshot:,} | {GIB // snapshot} | {base[1] / snapshot:.2f}x | {file_bytes:,} | "
              f"{base[2] / file_bytes:.2f}x |")
    print(f"MLX {mx.__version__}; device {mx.default_device()}; model {args.model or 'built-in default'}")


if __name__ == "__main__":
    main()
