"""``Model.load``: a model directory, ``.gguf`` file or Hugging Face repo id, ready to run.

    from butter_core import LoadOptions, Window
    from butter_core.model import Model

    model = Model.load(None, options=LoadOptions(kv_eviction=Window(2048, keep=4)))
    generation = model.generate(model.encode_prompt("Hello", chat=True))
    print(model.tokenizer.decode(list(generation)), generation.stats.summary())
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import TextIO

from butter_core.batch_generation import BatchGeneration
from butter_core.batched import BatchedCaches
from butter_core.cache import LayerCache
from butter_core.config import LoadOptions
from butter_core.distributed import shard_network, world
from butter_core.engine import Engine, TokenIds
from butter_core.errors import ButterWarning, ConfigError, ModelLoadError
from butter_core.generation import Generation
from butter_core.loading.resolve import resolve_model
from butter_core.prefix_cache import PrefixCache
from butter_core.loading.weights import WeightOptions, WeightSummary, load_network
from butter_core.models import DecoderModel
from butter_core.sampling import Sampler
from butter_core.tokenizer import Tokenizer


class Model:
    """A loaded model: its network, tokenizer and engine, and the options it was loaded with."""

    def __init__(
        self, network: DecoderModel, tokenizer: Tokenizer, options: LoadOptions, path: Path, weights: WeightSummary
    ):
        self.network = network
        self.tokenizer = tokenizer
        self.options = options
        self.path = path
        self.weights = weights
        self.engine = Engine(network, options)

    @classmethod
    def load(
        cls,
        path_or_id: str | os.PathLike | None = None,
        options: LoadOptions | None = None,
        *,
        weights: WeightOptions | None = None,
        progress_stream: TextIO | None = None,
    ) -> Model:
        """Load a model directory, ``.gguf`` file or Hugging Face repo id (None: the built-in default model).

        ``options`` chooses the KV cache scheme, eviction and context cap; ``weights``
        how checkpoint weights are kept (see ``WeightOptions``: by default dequantized
        to float32 on the CPU, as stored on a GPU). A GGUF file's first conversion shows
        its progress on ``progress_stream`` (None: silent).
        """
        options = options or LoadOptions()
        if not isinstance(options, LoadOptions):
            raise ConfigError(f"options must be a butter_core.LoadOptions, got {type(options).__name__}")
        path = resolve_model(path_or_id, progress_stream=progress_stream)
        network, summary = load_network(path, weights or WeightOptions())
        shard_network(network, world())  # launched on several processes (mlx.launch): each keeps its share
        tokenizer = Tokenizer.from_dir(path)
        if tokenizer.vocab_size > network.args.vocab_size:
            raise ModelLoadError(
                f"{path / 'tokenizer.json'}: the tokenizer has {tokenizer.vocab_size} tokens but config.json's "
                f"vocab_size is {network.args.vocab_size}"
            )
        trained = network.args.max_position_embeddings
        if options.max_context_length and options.max_context_length > trained:
            warnings.warn(
                f"--max-context {options.max_context_length} (max_context_length) is beyond the {trained} positions "
                f"the model was trained on (max_position_embeddings): output degrades past position {trained}",
                ButterWarning,
                stacklevel=2,
            )
        return cls(network, tokenizer, options, path, summary)

    def encode_prompt(self, text: str, *, chat: bool = False) -> list[int]:
        """Token ids of ``text``, as one user turn of the model's chat template when ``chat``."""
        if not chat:
            return self.tokenizer.encode(text)
        rendered = self.tokenizer.apply_chat_template([{"role": "user", "content": text}])
        return self.tokenizer.encode(rendered, add_special_tokens=False)

    def generate_batch(self, caches: BatchedCaches, *, prefill_chunk: int | None = None,
                       prefix_cache: PrefixCache | None = None) -> BatchGeneration:  # fmt: skip
        """Continuous batching over ``caches`` (``self.engine.make_batched_caches(capacity_tokens=...)``):
        ``add`` sequences, iterate for ``(sequence_id, token_id)``; a sequence stops at the model's
        end-of-sequence ids unless ``add`` gives others. With ``prefix_cache`` (``PrefixCache(max_bytes)``),
        prompts read whole are kept and later prompts that share a prefix with one start from it."""
        return BatchGeneration(self.engine, caches, stop_ids=self.tokenizer.eos_token_ids, prefill_chunk=prefill_chunk,
                               prefix_cache=prefix_cache)  # fmt: skip

    def generate(
        self,
        prompt_ids: TokenIds,
        caches: Sequence[LayerCache] | None = None,
        *,
        sampler: Sampler | None = None,
        max_tokens: int = 256,
        stop_ids: Collection[int] | None = None,
        prefill_progress: Callable[[int, int], None] | None = None,
        prefilled: Callable[[Sequence[LayerCache]], None] | None = None,
    ) -> Generation:
        """Stream tokens after ``prompt_ids`` (fresh caches unless given) until a stop id (default: the
        model's end-of-sequence ids) or ``max_tokens``; ``prefill_progress(done, total)`` follows a
        long prompt's prefill chunk by chunk; ``prefilled(caches)`` is called once the prompt is in
        the caches (to save them: ``butter_core.prompt_cache``)."""
        caches = self.engine.make_layer_caches() if caches is None else caches
        stop_ids = self.tokenizer.eos_token_ids if stop_ids is None else stop_ids
        return Generation(
            self.engine, prompt_ids, caches, sampler=sampler, max_tokens=max_tokens, stop_ids=stop_ids,
            prefill_progress=prefill_progress, prefilled=prefilled,
        )  # fmt: skip
