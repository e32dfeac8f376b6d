"""Prompt caches on disk: a model's layer caches after a prompt, in one safetensors file.

::

    caches = model.engine.make_layer_caches()
    mx.eval(model.engine.forward(prompt, caches))
    save_prompt_cache("system.safetensors", model, caches, prompt)

    cached = load_prompt_cache("system.safetensors", model)   # PromptCache: caches + tokens
    held = cached.resume(longer_prompt)                        # prompt tokens the caches now hold
    generation = model.generate(longer_prompt[held:], cached.caches)

The file holds every layer's ``LayerCache.state()`` in the scheme's own encoded form (aura
codes, affine codes, raw rows, recurrent states) as tensors ``layer.{i}.{name}``, the token ids
the caches hold (``tokens``), and metadata: the format and its version, the butter and MLX
versions, the tensor-parallel rank that saved it (each rank keeps its own heads' file), the model's path and fingerprint (its architecture and three embedding rows rounded
to bfloat16, so a fine-tune of the same architecture is told apart, and a model loaded in
another float dtype is not), the schemes (``--kv-cache``, ``--state-cache``) and eviction, and
per layer its cache class and ``meta_state()``. Loading checks each against the model it is
loaded for and names what differs; a file is written whole or not at all.

``PromptCache.resume`` keeps the longest common prefix of the held tokens and a new prompt, at
most all but the prompt's last token (whose logits the generation needs), by ``trim``; caches that
cannot drop positions (recurrent states, a window that has wrapped) are used only where the new
prompt extends every held token, and otherwise start empty.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import mlx.core as mx
import numpy as np

from butter_core.cache import LayerCache
from butter_core.distributed import total_bytes, world
from butter_core.errors import ConfigError
from butter_core.layer_caches import kv_cache_kind, layer_kinds
from butter_core.prefix_cache import shared_prefix
from butter_core.recurrent import StateSpec

if TYPE_CHECKING:
    from butter_core.engine import Engine
    from butter_core.model import Model

FORMAT = "butter-prompt-cache"
VERSION = 1


class PromptCacheError(ConfigError):
    """A prompt-cache file that cannot be read, or was saved for another model or scheme."""


@attrs.define
class PromptCache:
    """Layer caches loaded from a file for ``engine``'s model, and the token ids they hold."""

    engine: Engine
    caches: list[LayerCache]
    tokens: list[int]

    def resume(self, prompt: Sequence[int]) -> int:
        """Make the caches hold the longest common prefix of ``tokens`` and ``prompt`` that leaves
        the prompt's last token to feed, and return its length (see the module docstring)."""
        common = shared_prefix(np.asarray(self.tokens, dtype=np.int64), np.asarray(prompt, dtype=np.int64)[:-1])
        drop = len(self.tokens) - common
        if drop and not all(cache.trim(drop) == drop for cache in self.caches):
            self.caches, common = self.engine.make_layer_caches(), 0
        self.tokens = self.tokens[:common]
        return common


def model_fingerprint(model: Model) -> str:
    """A short hash of the model's architecture and of three embedding rows rounded to bfloat16."""
    args = attrs.asdict(model.network.args)
    vocab = model.network.args.vocab_size
    rows = model.network.embed(mx.array([[0, vocab // 2, vocab - 1]], dtype=mx.uint32)).astype(mx.bfloat16)
    digest = hashlib.sha256(json.dumps(args, sort_keys=True, default=str).encode())
    digest.update(np.array(rows.view(mx.uint16)).tobytes())
    return digest.hexdigest()[:16]


def _schemes(model: Model) -> dict[str, str]:
    options = model.options
    recurrent = [spec.layer_type for spec in model.engine.layer_specs() if isinstance(spec, StateSpec)]
    return {
        "kv_cache": str(kv_cache_kind(options)),
        "state_cache": str(layer_kinds(options)(recurrent[0])) if recurrent else "",
        "eviction": "" if options.kv_eviction is None else str(options.kv_eviction),
    }


def _version(distribution: str) -> str:
    try:
        return importlib_metadata.version(distribution)
    except importlib_metadata.PackageNotFoundError:
        return "unknown"


def save_prompt_cache(path: str | os.PathLike, model: Model, caches: Sequence[LayerCache], tokens: Sequence[int]) -> None:
    """Write ``caches`` (``model``'s, holding ``tokens``) to ``path`` as one safetensors file, whole
    or not at all (a temporary file beside it, renamed when complete)."""
    path = Path(path)
    model.engine.check_caches(caches)
    tokens = [int(t) for t in tokens]
    held = caches[0].absolute_position if caches else 0
    if held != len(tokens):
        raise ConfigError(f"save_prompt_cache: the caches hold {held} positions but {len(tokens)} token ids were given")
    arrays: dict[str, mx.array] = {"tokens": mx.array(tokens, dtype=mx.int32)}
    layers = []
    for index, cache in enumerate(caches):
        state = cache.state()
        arrays.update({f"layer.{index}.{name}": array for name, array in state.items()})
        layers.append({"cache": f"{type(cache).__module__}.{type(cache).__qualname__}", "meta": cache.meta_state(),
                       "arrays": sorted(state)})  # fmt: skip
    meta = {
        "format": FORMAT,
        "version": str(VERSION),
        "butter_core": _version("butter-core"),
        "mlx": mx.__version__,
        "model": str(model.path),
        "model_fingerprint": model_fingerprint(model),
        **_schemes(model),
        "positions": str(held),
        "shard": "{}/{}".format(*model.network.shard),
        "layers": json.dumps(layers),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        with open(temporary, "wb") as file:
            mx.save_safetensors(file, arrays, metadata=meta)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def load_prompt_cache(path: str | os.PathLike, model: Model) -> PromptCache:
    """``model``'s layer caches as saved in ``path`` (``save_prompt_cache``); ``PromptCacheError``
    naming the file where it is unreadable or was saved for another model, scheme or eviction."""
    path = Path(path)
    if not path.is_file():
        raise PromptCacheError(f"{path}: no such prompt-cache file")
    try:
        arrays, meta = mx.load(str(path), format="safetensors", return_metadata=True)
    except (RuntimeError, ValueError) as exc:
        raise PromptCacheError(f"{path}: not a readable safetensors file ({exc})") from None
    if meta.get("format") != FORMAT:
        raise PromptCacheError(f"{path}: not a butter prompt cache (its metadata has no format {FORMAT!r})")
    if meta.get("version") != str(VERSION):
        raise PromptCacheError(f"{path}: prompt-cache format version {meta.get('version')}; this butter reads {VERSION}")
    shard = "{}/{}".format(*model.network.shard)
    if meta.get("shard", "0/1") != shard:
        raise PromptCacheError(f"{path}: saved by tensor-parallel rank/ranks {meta.get('shard', '0/1')}; this process is "
                               f"{shard}: each rank loads the file it saved")  # fmt: skip
    if meta.get("model_fingerprint") != model_fingerprint(model):
        raise PromptCacheError(
            f"{path}: saved for another model ({meta.get('model')}); this is {model.path}: "
            "a prompt cache is only valid for the model that computed it"
        )
    for key, value in _schemes(model).items():
        if meta.get(key, "") != value:
            flag = {"kv_cache": "--kv-cache", "state_cache": "--state-cache", "eviction": "--kv-window-size"}[key]
            raise PromptCacheError(
                f"{path}: saved with {key} {meta.get(key) or 'none'}; this model runs {value or 'none'} "
                f"({flag}): load it with the same settings, or delete the file"
            )
    caches = model.engine.make_layer_caches()
    layers = json.loads(meta["layers"])
    if len(layers) != len(caches):
        raise PromptCacheError(f"{path}: {len(layers)} layer caches; this model keeps {len(caches)}")
    for index, (cache, layer) in enumerate(zip(caches, layers)):
        name = f"{type(cache).__module__}.{type(cache).__qualname__}"
        if layer["cache"] != name:
            raise PromptCacheError(f"{path}: layer {index} was saved by {layer['cache']}; this model's is {name}")
        try:
            cache.restore({n: arrays[f"layer.{index}.{n}"] for n in layer["arrays"]}, layer["meta"])
        except (ConfigError, KeyError, ValueError) as exc:
            raise PromptCacheError(f"{path}: layer {index} does not fit this model's cache: {exc}") from None
    tokens = arrays["tokens"].tolist()
    if caches and caches[0].absolute_position != len(tokens):
        raise PromptCacheError(f"{path}: holds {len(tokens)} token ids for {caches[0].absolute_position} positions")
    return PromptCache(model.engine, caches, tokens)


def rank_file(path: str | os.PathLike, model: Model) -> Path:
    """Where this process keeps ``path``'s prompt cache: ``path`` itself, or under tensor parallelism,
    where each rank holds its own heads' caches, ``path.rank{r}of{n}``."""
    path = Path(path)
    rank, ranks = model.network.shard
    return path if ranks == 1 else path.with_name(f"{path.name}.rank{rank}of{ranks}")


def resume_prompt_cache(path: str | os.PathLike, model: Model, prompt: Sequence[int]) -> tuple[list[LayerCache] | None, int]:
    """``model``'s caches from ``path`` (this rank's file: ``rank_file``) holding the longest usable prefix of
    ``prompt`` (``PromptCache.resume``) and its length; (None, 0) where the file does not exist yet (a first
    run), or where under tensor parallelism the ranks' files do not give all of them the same prefix (each
    rank must then run the same forward)."""
    path = rank_file(path, model)
    caches, held = None, 0
    if path.exists():
        cached = load_prompt_cache(path, model)
        caches, held = cached.caches, cached.resume(prompt)
    group = world()
    if group.size() > 1 and total_bytes(held, group) != held * group.size():
        return None, 0
    return caches, held
