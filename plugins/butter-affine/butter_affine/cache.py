"""``AffineCache``: K/V stored as affine-quantized codes with per-group scales and biases."""

from __future__ import annotations

import mlx.core as mx

from butter_core.plugin_api import BufferedSlotCache, LayerSpec, Mask, PrefillPipeline, StepCall, kernel_params

from butter_affine.kind import Affine
from butter_affine.ops import AffineOps, decode_kernel, select_ops
from butter_affine.kernels import decode_mma
from butter_affine.packing import BUFFERS, STACKS, PackedFormat


class AffineCache(BufferedSlotCache):
    """Six buffers ``[batch, n_kv_heads, allocated, width]`` (``packing.BUFFERS``): uint32
    codes and model-dtype scales and biases, for keys and for values, kept in two arrays
    (``packing.STACKS``: the codes, the scales and biases) so an append writes two.

    A position costs ``bits + 2 * 16 / group_size`` bits per element with 16-bit
    scales: 8.5 for affine8 (g64), 7 for affine6 (g32), 5 for affine4 (g32); against 16
    for bf16 raw. Buffers grow in whole steps (``butter_core.slots``) and appends write
    in place through slice assignment; ``store`` re-encodes every row it writes, so an
    overwritten slot (window eviction) keeps nothing of its previous codes, scales or
    biases. Multi-token attention dequantizes the live slots and uses MLX's SDPA, then
    hands its output to ``pipeline`` (shared by the layers of one model; None: no
    bound) so that few layers' dequantized K/V exist at once (``butter_core.working_set``);
    single-token attention uses the fastest path of this backend (``ops``), on CUDA with the
    token's write in the same traced call (``step_call``). In batched storage
    (``butter_core.batched``) on a GPU, a decode step reads every sequence's codes in place
    through its page table (``kernels.decode_mma.paged_decode_attention_stacks`` on CUDA's tensor
    cores where it serves the format, reading the storage's two stacks whole, else
    ``kernels.decode.paged_decode_attention``).
    """

    def __init__(self, spec: LayerSpec, kind: Affine, pipeline: PrefillPipeline | None = None):
        self.format = PackedFormat(kind.bits, kind.group_size, spec.head_dim, spec.dtype)
        super().__init__(spec, self.format.buffer_layout(), stacks=STACKS)
        self.ops: AffineOps = select_ops(self.format)
        self.pipeline = pipeline

    def encode(self, keys, values):
        return self.ops.quantize(keys.astype(self.spec.dtype), values.astype(self.spec.dtype))

    def decode(self, rows):
        slots = next(iter(rows.values())).shape[-2]
        if slots == 0:
            s = self.spec
            empty = mx.zeros((next(iter(rows.values())).shape[0], s.n_kv_heads, 0, s.head_dim), s.dtype)
            return empty, empty
        return self.ops.dequantize(rows, slots)

    def paged_decode(self, queries, buffers, table, lengths, page_size, length, scale):
        kernel = decode_kernel(self.format, queries.dtype)
        if kernel is None:
            return None
        options = {"table": table, "lengths": lengths, "page_size": page_size, "length": length, "scale": scale}
        if kernel is decode_mma:
            return decode_mma.paged_decode_attention_stacks(queries, buffers["codes"], buffers["scales_biases"], **options)
        return kernel.paged_decode_attention(queries, *(buffers[name] for name in BUFFERS), **options)

    def load(self, length):
        """``decode`` of the live slots, reading the whole buffers (the shape a traced kernel keeps)."""
        if length == 0 or not self.slots.allocated:
            return self.decode(self.slots.read(0))
        return self.ops.dequantize(self.slots.read(), length)

    def step_call(self, start, position, live, scale, dtype):
        step = self.ops.decode_step
        if step is None:
            return None
        self.slots.reserve(start + 1, live=self.length)
        storage = self.slots.read(stacked=True)
        return StepCall(step, (storage["codes"], storage["scales_biases"], kernel_params((start,), mx.int32),
                               kernel_params((live,), mx.int32), kernel_params((scale,), mx.float32)), self._take)

    def _take(self, written) -> None:
        """The stacks a ``step_call`` wrote, as the storage."""
        self.slots.replace(dict(zip(STACKS, written)))

    def attention(self, queries, *, scale: float, mask: Mask):
        if queries.shape[2] == 1 and mask is None and self.ops.decode is not None:
            return self.ops.decode(queries, self.slots.read(stacked=True), self.length, scale).astype(queries.dtype)
        out = super().attention(queries, scale=scale, mask=mask)
        if self.pipeline is not None:
            self.pipeline.submit(out)
        return out
