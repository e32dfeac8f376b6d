"""The fp8 scheme's GPU kernel, written once in butter's kernel dialect, with its reference.

``decode``: fp8 E4M3 codes times per-vector scales, to a float dtype — what ``load``
does before attention. One source builds as ``mx.fast.cuda_kernel`` (NVIDIA) or
``mx.fast.metal_kernel`` (Apple silicon) through ``butter_core.kernels.Kernel``; the
pure-mx reference is ``codec.decode``, used on the CPU. The kernel rounds exactly as the
reference does (E4M3 -> float32 is exact, then one float32 multiply, then one rounding
to the output dtype), so the two agree bit for bit.

E4M3 bit patterns 0x7F/0xFF are NaN; ``codec.encode`` never produces them (``to_fp8``
saturates at 448) and this kernel does not special-case them.

``KERNEL_CHECKS`` lists the kernel for the conformance suite.
"""

from __future__ import annotations

import mlx.core as mx

from butter_core.plugin_api import Kernel, KernelCheck
from butter_example_scheme import codec

_E4M3_HELPER = """
// E4M3: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal.
// Every step is exact in float32: (8 + m) * 2^e * 2^-10 = (1 + m/8) * 2^(e - 7).
BT_FUNC float butter_fp8_e4m3_to_float(unsigned int bits) {
  const unsigned int exponent = (bits >> 3) & 0xFu;
  const unsigned int mantissa = bits & 0x7u;
  const float magnitude = exponent == 0u
      ? static_cast<float>(mantissa) * 0.001953125f
      : static_cast<float>((8u + mantissa) << exponent) * 0.0009765625f;
  return (bits & 0x80u) ? -magnitude : magnitude;
}
"""

_DECODE = Kernel(
    name="butter_example_scheme_fp8_decode",
    input_names=("codes", "scales"),
    output_names=("out",),
    helpers=_E4M3_HELPER,
    body="""
  // One thread per element of codes [rows, D]; scales holds one value per row.
  const int64_t total = static_cast<int64_t>(codes_shape[0]) * D;
  const int64_t index = global_idx.x;
  if (index < total) {
    const float scale = bt_to_float(scales[index / D]);
    out[index] = bt_from_float<T>(butter_fp8_e4m3_to_float(codes[index]) * scale);
  }
""",
)

_THREADS = 256


def decode(codes: mx.array, scales: mx.array, dtype: mx.Dtype) -> mx.array:
    """``codec.decode`` on the GPU: codes ``[..., D]`` (uint8), scales ``[..., 1]``, to ``dtype``."""
    if codes.size == 0:
        return codec.decode(codes, scales, dtype)
    dims = codes.shape[-1]
    (out,) = _DECODE(
        inputs=[codes.reshape(-1, dims), scales.reshape(-1)],
        # S is unused in the body, but compiled CUDA kernels are cached by name and
        # template only, so every input dtype that can vary must be a template value.
        template=[("T", dtype), ("S", scales.dtype), ("D", dims)],
        grid=(codes.size, 1, 1),
        threadgroup=(_THREADS, 1, 1),
        output_shapes=[(codes.size // dims, dims)],
        output_dtypes=[dtype],
    )
    return out.reshape(codes.shape)


def available() -> bool:
    """Whether the kernel can run here (a Metal or CUDA build of MLX)."""
    return _DECODE.available()


def make_decode_inputs(
    seed: int, *, rows: int = 64, head_dim: int = 128, scale_dtype=mx.float16, dtype=mx.bfloat16
) -> dict:
    """Codes and scales of random vectors (spread over six orders of magnitude), as ``encode`` makes them."""
    vectors, magnitudes = mx.random.split(mx.random.key(seed))
    x = mx.random.normal((rows, head_dim), key=vectors) * 10.0 ** mx.random.uniform(-3, 3, (rows, 1), key=magnitudes)
    codes, scales = codec.encode(x, scale_dtype)
    return {"codes": codes, "scales": scales, "dtype": dtype}


KERNEL_CHECKS: tuple[KernelCheck, ...] = (
    KernelCheck(
        name="fp8_decode",
        kernel=decode,
        reference=codec.decode,
        make_inputs=make_decode_inputs,
        cases=(
            {},
            {"rows": 1, "head_dim": 64, "dtype": mx.float32},
            {"rows": 3000, "head_dim": 128, "dtype": mx.float16, "scale_dtype": mx.float32},
            {"rows": 77, "head_dim": 96, "dtype": mx.float32, "scale_dtype": mx.float32},
        ),
        rtol={mx.float32: 0.0, mx.float16: 0.0, mx.bfloat16: 0.0},
    ),
)
"""The fp8 kernel with its reference; it must match exactly (tolerance 0)."""
