"""``FP8Cache``: a ``SlotCache`` storing keys and values as fp8 E4M3 codes plus per-vector scales."""

from __future__ import annotations

import mlx.core as mx

from butter_core.plugin_api import BufferedSlotCache, LayerSpec, default_device_is_gpu
from butter_example_scheme import codec, kernels
from butter_example_scheme.kind import FP8


class FP8Cache(BufferedSlotCache):
    """Four buffers per layer: ``keys``/``values`` (uint8 codes, ``[B, H, S, head_dim]``)
    and ``key_scales``/``value_scales`` (``[B, H, S, 1]`` in the kind's scale dtype).

    One position costs ``2 * (head_dim + scale bytes)`` bytes per head: 260 bytes for
    head_dim 128 with float16 scales, against 512 for a bf16 raw cache. Attention
    dequantizes the live slots to the model dtype and uses core's default attention
    (no fused attention kernel). Dequantizing runs the scheme's GPU kernel when MLX's
    default device is a GPU, its pure-mx reference otherwise: chosen once, here.
    """

    def __init__(self, spec: LayerSpec, kind: FP8):
        self.scale_dtype: mx.Dtype = getattr(mx, kind.scale_dtype)
        layout = {
            "keys": (spec.head_dim, mx.uint8),
            "key_scales": (1, self.scale_dtype),
            "values": (spec.head_dim, mx.uint8),
            "value_scales": (1, self.scale_dtype),
        }
        super().__init__(spec, layout)
        self._decode = kernels.decode if default_device_is_gpu() and kernels.available() else codec.decode

    def encode(self, keys, values):
        key_codes, key_scales = codec.encode(keys, self.scale_dtype)
        value_codes, value_scales = codec.encode(values, self.scale_dtype)
        return {"keys": key_codes, "key_scales": key_scales, "values": value_codes, "value_scales": value_scales}

    def decode(self, rows):
        dtype = self.spec.dtype
        return (
            self._decode(rows["keys"], rows["key_scales"], dtype),
            self._decode(rows["values"], rows["value_scales"], dtype),
        )
