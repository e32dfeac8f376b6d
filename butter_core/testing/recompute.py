"""The yardstick for model-level checks: greedy decoding by full recomputation, no cache.

A cached run must produce what recomputing the whole sequence after every token
produces; under window eviction, a recompute masked to the same windows
(``butter_core.engine.cache_windows(caches)``).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from butter_core.config import Window
from butter_core.models import DecoderModel


def greedy_recompute(
    network: DecoderModel, prompt_ids: Sequence[int], steps: int, windows: Sequence[Window | None] | None = None
) -> tuple[list[int], mx.array]:
    """``steps`` greedy tokens after ``prompt_ids`` and their logits ``[steps, vocab]``, each step a full recompute."""
    ids, tokens, logits = list(prompt_ids), [], []
    for _ in range(steps):
        last = network(mx.array(ids)[None], None, windows)[0, -1]
        token = mx.argmax(last).item()
        tokens.append(token)
        logits.append(last)
        ids.append(token)
    return tokens, mx.stack(logits)
