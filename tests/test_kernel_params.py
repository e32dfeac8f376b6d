"""``kernel_params``: per-call kernel parameters, made once per value and backend."""

import mlx.core as mx
import pytest

from butter_core.kernels import kernel_params
from butter_core.kernels.params import _made


def test_the_same_values_give_the_same_array():
    first = kernel_params((4096,), mx.int32)
    assert kernel_params([4096], mx.int32) is first
    assert kernel_params((4097,), mx.int32) is not first
    assert kernel_params((4096,), mx.float32) is not first
    assert first.dtype == mx.int32 and first.tolist() == [4096]


@pytest.mark.parametrize("backend", [None, "metal", "cuda"])
@pytest.mark.parametrize(
    ("values", "dtype"),
    [((7,), mx.int32), ((0.125,), mx.float32), ((1.5,), mx.float16), ((9, 4, 32, -1, 40), mx.int32)],
)
def test_values_shape_and_dtype_on_every_backend(backend, values, dtype):
    """CUDA's form is padded past the host pool and sliced back: callers see exactly the values."""
    made = _made(values, dtype, backend)
    assert made.shape == (len(values),) and made.dtype == dtype
    assert made.tolist() == list(values)

