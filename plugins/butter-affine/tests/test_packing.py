"""The stored format: MLX's packing, the bytes it costs, and the codec's own promises."""

import mlx.core as mx
import numpy as np
import pytest

from butter_core import LayerSpec, make_layer_caches, parse_kv_cache
from butter_core.testing import on_the_cpu  # noqa: F401 - a fixture

from butter_affine import codec
from butter_affine.packing import BUFFERS, PackedFormat

FORMATS = [(4, 32), (4, 64), (4, 128), (6, 32), (6, 64), (8, 32), (8, 64), (8, 128)]


def relative_error(out, ref):
    out, ref = out.astype(mx.float32), ref.astype(mx.float32)
    return (mx.linalg.norm((out - ref).reshape(-1)) / mx.linalg.norm(ref.reshape(-1))).item()


@pytest.mark.parametrize(("name", "bits_per_element"), [("affine8", 8.5), ("affine6", 7.0), ("affine4", 5.0)])
def test_allocated_bits_per_element(name, bits_per_element):
    """Measured from the arrays a cache holds (bf16 model, head_dim 128), not from arithmetic."""
    spec = LayerSpec(n_kv_heads=8, head_dim=128, max_positions=1024, dtype=mx.bfloat16)
    (cache,) = make_layer_caches(parse_kv_cache(name), [spec])
    cache.append(*(mx.random.normal((1, 8, 512, 128)).astype(mx.bfloat16) for _ in range(2)))
    mx.eval(cache.buffers())
    slots = cache.slots.allocated
    elements = 2 * spec.n_kv_heads * slots * spec.head_dim
    assert cache.nbytes_allocated * 8 / elements == bits_per_element
    assert sum(b.nbytes for b in cache.buffers()) == cache.nbytes_allocated
    raw_bytes = elements * 2
    print(f"{name}: {bits_per_element} bits/element, {cache.nbytes_allocated / raw_bytes:.3f}x bf16 raw")


@pytest.mark.parametrize(("bits", "group_size"), FORMATS)
def test_float32_packing_is_mlx_quantize(bits, group_size):
    """In float32 the reference is ``mx.quantize`` exactly, codes included."""
    x = mx.random.normal((2, 3, 7, 128), key=mx.random.key(bits * group_size)) * 3
    ours = codec.quantize(x, bits, group_size)
    theirs = mx.quantize(x, group_size=group_size, bits=bits)
    assert all(mx.array_equal(a, b).item() for a, b in zip(ours, theirs))


@pytest.mark.usefixtures("on_the_cpu")  # exact against mx.quantize as MLX's CPU computes it (its CUDA
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])  # kernel rounds some scales one bf16 step apart)
@pytest.mark.parametrize(("bits", "group_size"), FORMATS)
def test_half_precision_packing_reads_back_through_mlx(bits, group_size, dtype):
    """Scales and biases are ``mx.quantize``'s; codes are computed against their rounded values,
    and ``mx.dequantize`` / the reference decode them to within one rounding of the dtype."""
    x = (mx.random.normal((1, 4, 9, 128), key=mx.random.key(7)) * 2).astype(dtype)
    codes, scales, biases = codec.quantize(x, bits, group_size)
    _, mlx_scales, mlx_biases = mx.quantize(x, group_size=group_size, bits=bits)
    assert mx.array_equal(scales, mlx_scales).item() and mx.array_equal(biases, mlx_biases).item()
    ours = codec.dequantize(codes, scales, biases, bits, mx.float32)
    theirs = mx.dequantize(codes, scales, biases, group_size=group_size, bits=bits).astype(mx.float32)
    assert relative_error(theirs, ours) < {mx.float16: 2e-3, mx.bfloat16: 1.5e-2}[dtype]


def test_rounded_scale_codes_lower_bf16_error():
    """Codes against the stored bf16 scale: 8-bit reconstruction error 0.0054 instead of 0.0072."""
    x = mx.random.normal((1, 8, 256, 128), key=mx.random.key(3)).astype(mx.bfloat16)
    ours = codec.dequantize(*codec.quantize(x, 8, 64), 8, mx.float32)
    theirs = codec.dequantize(*mx.quantize(x, group_size=64, bits=8), 8, mx.float32)
    assert relative_error(ours, x) < 0.8 * relative_error(theirs, x)


@pytest.mark.parametrize("bits", [4, 6, 8])
def test_pack_unpack_round_trip(bits):
    codes = mx.array(np.random.default_rng(bits).integers(0, 2**bits, (3, 5, 128)), dtype=mx.uint32)
    packed = codec.pack(codes, bits)
    assert packed.shape == (3, 5, 128 * bits // 32) and packed.dtype == mx.uint32
    assert mx.array_equal(codec.unpack(packed, bits), codes).item()


@pytest.mark.parametrize(("bits", "group_size"), FORMATS)
def test_dequantize_planes_hold_the_rows_coordinates(bits, group_size):
    x = mx.random.normal((2, 3, 5, 128), key=mx.random.key(bits + group_size))
    codes, scales, biases = codec.quantize(x, bits, group_size)
    rows = codec.dequantize(codes[:, :, 1:4], scales[:, :, 1:4], biases[:, :, 1:4], bits, mx.float32)
    planes = codec.dequantize_planes(codes[:, :, 1:4], scales[:, :, 1:4], biases[:, :, 1:4], bits, mx.float32)
    assert len(planes) == {4: 2, 6: 4, 8: 1}[bits]
    for k, plane in enumerate(planes):
        assert mx.array_equal(plane, rows[..., k::len(planes)]).item()


def test_six_bit_codes_are_byte_packed():
    """Four 6-bit codes in three little-endian bytes, MLX's sub-byte layout."""
    codes = mx.array([[1, 2, 3, 63] * 8], dtype=mx.uint32)
    as_bytes = np.array(mx.view(codec.pack(codes, 6), mx.uint8))[0, :3]
    triple = 1 | 2 << 6 | 3 << 12 | 63 << 18
    assert as_bytes.tolist() == [triple & 0xFF, triple >> 8 & 0xFF, triple >> 16]


@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_degenerate_groups(bits, dtype):
    """All-zero and constant groups decode exactly; a float16 scale that underflows does not give NaN."""
    x = mx.concatenate(
        [mx.zeros((1, 1, 1, 32)), mx.full((1, 1, 1, 32), -2.5), mx.full((1, 1, 1, 32), 3e-8)], axis=-1
    ).astype(dtype)
    out = codec.dequantize(*codec.quantize(x, bits, 32), bits, mx.float32)
    assert not mx.any(mx.isnan(out)).item()
    assert mx.array_equal(out[..., :64], x[..., :64].astype(mx.float32)).item()


@pytest.mark.parametrize(("bits", "expected"), [(8, 0.0054), (6, 0.0193), (4, 0.081)])
def test_reconstruction_error_of_gaussian_rows(bits, expected):
    """Default groups (64 for 8 bits, 32 otherwise): the per-element error the tolerances rest on."""
    group_size = 64 if bits == 8 else 32
    x = mx.random.normal((1, 8, 512, 128), key=mx.random.key(11))
    err = relative_error(codec.dequantize(*codec.quantize(x, bits, group_size), bits, mx.float32), x)
    assert err == pytest.approx(expected, rel=0.05)


def test_format_sizes():
    fmt = PackedFormat(6, 32, 128, mx.bfloat16)
    assert (fmt.words, fmt.groups, fmt.row_bytes, fmt.bits_per_element) == (24, 4, 112, 7.0)
    assert set(fmt.buffer_layout()) == set(BUFFERS)
    assert PackedFormat.of(mx.zeros((1, 1, 1, 24), mx.uint32), mx.zeros((1, 1, 1, 4), mx.bfloat16), 128) == fmt
