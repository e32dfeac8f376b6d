"""``compile_by_shape``: ``mx.compile`` with a bounded number of traces.

``mx.compile`` keeps every trace it makes (one per distinct set of input shapes and
dtypes) for as long as the compiled function lives, and finds the trace for a call by
trying them one after another. A cache calls its compiled functions with shapes that
change as it grows (every ``GROWTH_STEP`` slots, or every step where a function sees
only the live slots), so an unbounded function's lookups get slower the longer a
generation runs (measurements: docs/benchmarks.md, "butter_core/compiled.py").
``compile_by_shape`` keeps the traces of the last few shapes only.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable

import mlx.core as mx

KEEP = 4
"""Traces kept per function: the layers of one model share shapes, so a decode step needs
one; a few more serve callers that alternate (two models, prefill and decode)."""


def compile_by_shape(fn: Callable[..., mx.array | tuple], keep: int = KEEP, after: int = 1) -> Callable:
    """``fn`` (arrays in, arrays out) compiled once per distinct set of input shapes (each
    compiled function traces every new set of dtypes itself), with the ``keep`` most
    recently used kept.

    A set of shapes is traced at its ``after``-th call; the calls before it run ``fn`` as it
    is. Where tracing costs more than a few calls save (a decoder block's step, traced per
    batch size), a shape seen once or twice, such as a batch size that lasts a step while
    sequences join and leave, is not worth a trace.

    Each trace is its own ``mx.compile`` of ``fn``; dropping one releases what MLX held
    for it. Positional array arguments only: anything else ``fn`` needs, bind first
    (``functools.partial``), so it is the same for every call.
    """
    if keep < 1:
        raise ValueError(f"compile_by_shape keeps at least one trace; got keep={keep}")
    if after < 1:
        raise ValueError(f"compile_by_shape traces at a shape's first call or later; got after={after}")
    traces: OrderedDict[tuple, Callable] = OrderedDict()
    calls: OrderedDict[tuple, int] = OrderedDict()  # shapes not traced yet: their calls so far, `keep` kept
    latest: list = [None, None]  # the most recent call's key and trace: a decode step's layers repeat it

    @functools.wraps(fn)
    def call(*arrays: mx.array):
        # Shapes only, on the host path of every decode step's layers: reading the dtypes too
        # doubles the cost, and a compiled function traces each new set of dtypes itself.
        key = tuple([a.shape for a in arrays])
        if key == latest[0]:
            return latest[1](*arrays)
        compiled = traces.pop(key, None)
        if compiled is None and after > 1:
            count = calls.pop(key, 0) + 1
            if count < after:
                calls[key] = count
                if len(calls) > keep:
                    calls.popitem(last=False)
                return fn(*arrays)
        if compiled is None:
            # A fresh function object per trace: MLX keys its traces by the function's identity.
            compiled = mx.compile(functools.partial(fn))
            call.made += 1
            if len(traces) >= keep:
                traces.popitem(last=False)
        traces[key] = compiled
        latest[:] = key, compiled
        return compiled(*arrays)

    def clear() -> None:
        """Drop every trace (the next call of each shape traces anew)."""
        traces.clear()
        calls.clear()
        latest[:] = None, None

    call.traces, call.clear = traces, clear
    call.made = 0
    """Traces made so far, those dropped included: shapes that churn show as many more than kept."""
    return call


@functools.cache
def traced(fn: Callable[..., tuple]) -> Callable:
    """``compile_by_shape(fn)``, one per function: what runs a scheme's ``StepCall`` (``SlotCache.step_call``),
    whose function every layer of a model shares, and so its traces."""
    return compile_by_shape(fn)
