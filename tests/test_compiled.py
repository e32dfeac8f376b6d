"""``butter_core.compiled.compile_by_shape``: one trace per shape, a bounded number kept."""

import mlx.core as mx
import pytest

from butter_core.compiled import compile_by_shape


def counting(keep, after=1):
    traced = []

    def fn(a, b):
        traced.append(a.shape)  # runs only while MLX traces
        return a * 2 + b, a.sum()

    return compile_by_shape(fn, keep=keep, after=after), traced


def test_results_match_the_uncompiled_function():
    f, _ = counting(keep=2)
    a, b = mx.arange(6, dtype=mx.float32).reshape(2, 3), mx.ones((2, 3))
    out, total = f(a, b)
    assert mx.array_equal(out, a * 2 + b).item() and total.item() == 15


def test_each_shape_is_traced_once_while_kept():
    f, traced = counting(keep=2)
    for _ in range(3):
        f(mx.zeros((2, 3)), mx.zeros((2, 3)))
    assert traced == [(2, 3)]
    f(mx.zeros((4, 3)), mx.zeros((4, 3)))
    f(mx.zeros((2, 3)), mx.zeros((2, 3)))
    assert traced == [(2, 3), (4, 3)]
    f(mx.zeros((2, 3), mx.float16), mx.zeros((2, 3), mx.float16))  # MLX traces a new set of dtypes itself
    assert len(traced) == 3
    out, _ = f(mx.ones((2, 3), mx.float16), mx.ones((2, 3), mx.float16))
    assert out.dtype == mx.float16 and len(traced) == 3


def test_only_the_most_recently_used_traces_are_kept():
    f, traced = counting(keep=2)
    shapes = [(1, 3), (2, 3), (1, 3), (3, 3)]  # (1, 3) used again, so (2, 3) is the oldest
    for shape in shapes:
        f(mx.zeros(shape), mx.zeros(shape))
    assert list(key[0] for key in f.traces) == [(1, 3), (3, 3)]
    f(mx.zeros((2, 3)), mx.zeros((2, 3)))  # dropped: traced again
    assert traced == [(1, 3), (2, 3), (3, 3), (2, 3)]
    assert len(f.traces) == 2 and f.made == 4


def test_a_shape_is_traced_at_its_after_th_call():
    f, traced = counting(keep=2, after=3)
    a, b = mx.arange(6, dtype=mx.float32).reshape(2, 3), mx.ones((2, 3))
    for call in range(5):
        out, total = f(a, b)  # the same results traced or not
        assert mx.array_equal(out, a * 2 + b).item() and total.item() == 15
        assert len(traced) == call + 1 if call < 3 else len(traced) == 3  # run as it is twice, then traced once
    assert list(f.traces) == [((2, 3), (2, 3))] and f.made == 1


def test_untraced_shapes_calls_are_counted_for_the_most_recent_only():
    f, traced = counting(keep=2, after=2)
    for shape in [(1, 3), (2, 3), (3, 3), (1, 3)]:  # (1, 3)'s first call forgotten: run as it is again
        f(mx.zeros(shape), mx.zeros(shape))
    assert not f.traces and len(traced) == 4
    f(mx.zeros((1, 3)), mx.zeros((1, 3)))
    assert list(key[0] for key in f.traces) == [(1, 3)]


def test_keep_and_after_must_be_positive():
    with pytest.raises(ValueError, match="keep=0"):
        compile_by_shape(lambda a: a, keep=0)
    with pytest.raises(ValueError, match="after=0"):
        compile_by_shape(lambda a: a, after=0)
