"""``PrefillPipeline``: the MLX form of the seed's one working buffer shared by all layers.

A compressed scheme's multi-token attention dequantizes a layer's whole live K/V (``[B, H,
length, D]`` in the model dtype) for MLX's SDPA (butter-affine, butter-aura: each shares one
pipeline between the caches of a model). The seed dequantizes every layer into one shared pair
of buffers. MLX has no such thing (a kernel's output is a fresh array), but its
allocator reuses a buffer once nothing needs it, so what matters is how long each
layer's dequantized K/V stay alive:

- On the CPU they die as soon as the layer's attention has run: a 30-layer step's
  working set is one layer's, the same as a 5-layer step's (``tests/test_memory.py``).
- On CUDA, a graph evaluated as one (a whole model's forward, as ``Engine.forward``
  does per chunk) keeps each layer's buffers until the GPU has finished that part of
  the graph, and the host runs ahead: a 30-layer step's working set grows to most of
  its layers' dequantized K/V.

A ``PrefillPipeline`` shared by all layers of one model bounds it: after each layer's
multi-token attention it submits that layer (``mx.async_eval``) and waits for the
layer before it, so the GPU always has the next layer queued while at most
``depth + 1`` layers' dequantized K/V exist; the step is faster too, sparing the one
graph's fresh allocations. Measurements: docs/benchmarks.md,
"plugins/butter-affine/butter_affine/working_set.py" (where it lived before both schemes used
it). Single-token attention never goes through it (on CUDA it reads the codes and
dequantizes nothing).
"""

from __future__ import annotations

from collections import deque

import mlx.core as mx

from butter_core.kernels import default_device_is_gpu


class PrefillPipeline:
    """Keeps at most ``depth`` submitted layers in flight behind the newest one (GPU only)."""

    def __init__(self, depth: int = 1):
        if depth < 0:
            raise ValueError(f"depth must be >= 0, got {depth}")
        self.depth = depth
        self._in_flight: deque[mx.array] = deque()

    def submit(self, layer_output: mx.array) -> None:
        """Queue ``layer_output`` (a layer's attention output ``[B, heads, tokens, D]``) on the GPU;
        wait for older layers beyond ``depth``.

        A single token's output passes by: decode dequantizes nothing, and waiting on its layers
        would only stall the host. On the CPU it does nothing: there the buffers are already
        freed as the graph runs.
        """
        if layer_output.shape[2] == 1 or not default_device_is_gpu():
            return
        mx.async_eval(layer_output)
        self._in_flight.append(layer_output)
        while len(self._in_flight) > self.depth:
            mx.eval(self._in_flight.popleft())
