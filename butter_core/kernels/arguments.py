"""Per-call integers a kernel reads by value, as the shape of an empty array.

A kernel's per-call scalars (a live length, a ring's range, a softmax scale) could be
passed as small arrays made on the host for each call, but on CUDA MLX keeps arrays made
on the host in unified memory: up to 8 bytes in a pool that stays in host memory, larger
ones in managed memory that migrates to the GPU on its first touch there. Every
threadgroup's first read of such a scalar then waits on the bus or on a page migration
(H200, side by side, fresh host arrays against device-resident copies: affine4 decode at
4k 33.5 against 30.3 µs, aura4v2 39.5 against 35.8; docs/architecture.md).

MLX passes every input's shape by value with the launch (``{name}_shape`` in the kernel,
when the body names it). ``by_value(a, b, ...)`` is an empty array of shape ``(a, b, ...,
0)``: it allocates nothing, and the kernel reads value ``i`` as ``{name}_shape[i]``
(written out in the body: MLX passes the shape only when the body's text names it). The
empty dimension comes last so that every stride is 0: the product of large values never
overflows MLX's int64 strides.
A positive float travels as its bits (``float_bits``), read back with ``bt_as_float``.
"""

from __future__ import annotations

import struct

import mlx.core as mx

MAX_VALUES = 9
"""Values one array carries: MLX kernels take shapes of up to 10 dimensions."""


def by_value(*values: int) -> mx.array:
    """An empty int32 array whose shape ``(*values, 0)`` carries ``values`` (each in
    ``[0, 2**31)``) to a kernel."""
    if not 0 < len(values) <= MAX_VALUES:
        raise ValueError(f"by_value carries 1 to {MAX_VALUES} values; got {len(values)}")
    for value in values:
        if not isinstance(value, int) or not 0 <= value < 2**31:
            raise ValueError(f"by_value carries integers in [0, 2**31); got {value!r}")
    return mx.zeros((*values, 0), dtype=mx.int32)


def float_bits(value: float) -> int:
    """The float32 bits of a positive finite ``value``, as a non-negative int for
    ``by_value`` (the kernel reads it back with ``bt_as_float``)."""
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    if not value > 0 or bits >= 0x7F800000:
        raise ValueError(f"float_bits carries positive finite floats; got {value!r}")
    return bits
