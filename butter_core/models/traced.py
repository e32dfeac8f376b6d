"""A decoder block's decode step as two traced calls around its cache, or one with it.

A decode step on a GPU is bound by the host (docs/benchmarks.md, issue 32): every MLX operation
a layer builds costs host time, and a Llama or Qwen3 block builds about a dozen around its
cache (the input norm, the projections, the per-head norms, RoPE, the output projection and
its residual, the second norm, the feed-forward and its residual). ``TracedDecode`` builds
the operations before the cache and those after it as one ``mx.compile`` replay each, traced
per input shape (``compile_by_shape``: one sequence's step, a batch of a given size) once the
shape has come ``AFTER`` times, the ``KEEP`` most recent kept.

The block's weights are constants of the traces, so a trace is used only while every weight
it read is still the block's (``TracedDecode.current``): a weight replaced later
(``load_weights``, ``set_dtype``, a fusion redone) makes the block trace again, never run a
stale copy.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

from butter_core.compiled import compile_by_shape
from butter_core.kernels.params import kernel_params

ENABLED = True
"""False: every block runs its decode step op by op (``bench/fused_projections.py --switch traced``
compares the two step by step)."""

KEEP = 64
"""Traces kept per half, one per batch size: a batched engine's batch size moves as sequences join
and leave, and tracing a block anew costs about half a millisecond of host time (a 28-layer
model about 15 ms), while a kept trace holds no data of its own (its constants are the block's
weights), so every size a batch usually takes is kept (docs/benchmarks.md)."""

AFTER = 3
"""A batch size is traced at its third step: one that lasts a step or two while sequences join and
leave runs op by op rather than pay for a trace it would not use again."""


class TracedDecode:
    """The traced halves of one block's decode step: ``before`` (hidden states and RoPE offsets in,
    RoPE'd queries and keys and the values out) and ``after`` (the attention's output and the
    block's input in, the block's output out); and, where the cache hands its step out as a
    ``StepCall`` (``SlotCache.decode_call``), the whole step as one trace (``with_cache``)."""

    def __init__(self, block: nn.Module):
        self.before: Callable = compile_by_shape(block.before_cache, keep=KEEP, after=AFTER)
        self.after: Callable = compile_by_shape(block.after_cache, keep=KEEP, after=AFTER)
        self._halves = block.before_cache, block.after_cache
        self._whole: dict[Callable, Callable] = {}
        read = [(module, name, value) for _, module in block.named_modules() for name, value in module.items()
                if isinstance(value, mx.array)]  # fmt: skip
        self._modules = tuple(module for module, _, _ in read)
        self._names = tuple(name for _, name, _ in read)
        self._read = tuple(id(array) for _, _, array in read)

    def with_cache(self, function: Callable) -> Callable:
        """``before``, a cache's step ``function`` (a ``StepCall``'s: queries, keys and values, then the
        call's inputs; the output, then the arrays it wrote) and ``after`` as one trace per shape:
        ``(x, offset, *inputs) -> (block output, *written)``. One replay a layer where the halves and
        the cache's own trace take three, on a decode step that a GPU's host sets the pace of."""
        whole = self._whole.get(function)
        if whole is None:
            before, after = self._halves

            def step(x, offset, *inputs):
                out, *written = function(*before(x, offset), *inputs)
                return (after(out, x), *written)

            whole = self._whole[function] = compile_by_shape(step, keep=KEEP, after=AFTER)
        return whole

    def current(self) -> bool:
        """Whether every parameter array the traces read is still the block's. That covers the fused
        projections (``fused``) too: a fusion makes its layers' weights views of its own, so making
        or dropping one replaces parameters. (A trace keeps its arrays alive, so no new array
        takes an old one's id.)"""
        return tuple(map(id, map(dict.get, self._modules, self._names))) == self._read


def rope_offset(offset: int | mx.array) -> mx.array:
    """A cache's ``absolute_position`` as a trace's input: an array already (one per sequence), else
    one int32 element every layer of a step shares (``kernel_params``)."""
    return offset if isinstance(offset, mx.array) else kernel_params((offset,), mx.int32)
