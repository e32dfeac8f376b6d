"""Fewer operations a layer: projections that read the same input computed by one matmul, a
projection added to the residual stream in the matmul's own epilogue (over several rows), and
weights multiplied through a transpose held since they were loaded. A decode step's host time
is paid per operation (docs/benchmarks.md, issue 32): q/k/v and gate/up are three and two, each
block adds two projections to its residual, and ``x @ weight.T`` is two operations (a
``Transpose`` and the product) every time a graph is built or a trace replayed.

``FusedLinear.of(linears)`` concatenates the weights (and biases) of plain ``nn.Linear``
layers along their outputs into one array and makes each layer's own weight a view of it,
so the model keeps one copy, its parameters keep their Hugging Face names, and the layers
still work alone. A fused product is used only while every layer still holds the view it
was given (``current``): a weight replaced later (``load_weights``, ``set_dtype``) makes
the layers run one by one again, never from a stale copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn


class FusedLinear:
    """One weight ``[sum of outputs, inputs]`` whose row blocks are the weights of ``linears``.

    A plain object, not an ``nn.Module``: its arrays are not parameters of the model (they
    are the same memory as the layers' own)."""

    def __init__(self, linears: Sequence[nn.Linear]):
        self.linears = tuple(linears)
        has_bias = "bias" in linears[0]
        self.weight = mx.concatenate([linear.weight for linear in linears], axis=0)
        self.bias = mx.concatenate([linear.bias for linear in linears]) if has_bias else None
        ends = [0]
        for linear in linears:
            ends.append(ends[-1] + linear.weight.shape[0])
        self.splits = ends[1:-1]
        """Where each layer's outputs end, the last excepted (``mx.split``'s indices)."""
        self.transposed = self.weight.T
        mx.eval(self.weight, self.bias, self.transposed)
        self.views = []
        for linear, start, end in zip(linears, ends, ends[1:]):
            linear.weight = self.weight[start:end]
            if has_bias:
                linear.bias = self.bias[start:end]
            self.views.append((linear.weight, linear.get("bias")))
        mx.eval(self.views)

    @classmethod
    def of(cls, linears: Sequence[nn.Module]) -> FusedLinear | None:
        """The fusion of ``linears``, or None where they cannot share one matmul: not all plain
        ``nn.Linear`` (quantized, sharded), of different input sizes or dtypes, some with a bias
        and some without."""
        if not all(type(linear) is nn.Linear for linear in linears):
            return None
        first = linears[0]
        if any(linear.weight.shape[1] != first.weight.shape[1] or linear.weight.dtype != first.weight.dtype
               or ("bias" in linear) != ("bias" in first) for linear in linears):  # fmt: skip
            return None
        return cls(linears)

    def current(self) -> bool:
        """Whether every layer still holds the view of the fused weight it was given."""
        return all(linear.weight is weight and linear.get("bias") is bias
                   for linear, (weight, bias) in zip(self.linears, self.views))  # fmt: skip

    def __call__(self, x: mx.array) -> list[mx.array]:
        """Each layer's output of ``x``, from one matmul (views of its columns)."""
        return mx.split(product(x, self.transposed, self.bias), self.splits, axis=-1)


def one_row(x: mx.array) -> bool:
    """Whether ``x`` is a single row (one sequence's decode step), whose product with a matrix
    keeps its sum apart: MLX's CUDA backend multiplies one row by its matrix-vector kernel but
    hands ``addmm`` to cuBLASLt, which made that step 1.5x slower (docs/benchmarks.md)."""
    return x.size == x.shape[-1]


def product(x: mx.array, transposed: mx.array, add: mx.array | None) -> mx.array:
    """``x @ transposed + add`` (no sum for None) as few operations as the backend runs well: one
    (``mx.addmm``) over several rows, two for a single row (``one_row``)."""
    if add is None:
        return x @ transposed
    if one_row(x):
        return x @ transposed + add
    return mx.addmm(add, x, transposed)


def held_transpose(linear: nn.Linear) -> mx.array:
    """``linear.weight.T``, evaluated when first asked for and held until the weight is replaced:
    a view of the weight (no copy) that a graph reads as an input, with no ``Transpose`` of its own."""
    held = linear.__dict__.get("_held_transpose")
    if held is None or held[0] is not linear.weight:
        transposed = linear.weight.T
        mx.eval(transposed)
        held = (linear.weight, transposed)
        # Kept out of the module's parameters, as ``fuse_projections`` keeps its fusions.
        object.__setattr__(linear, "_held_transpose", held)
    return held[1]


def plus(linear: nn.Module, x: mx.array, residual: mx.array | None = None) -> mx.array:
    """``residual + linear(x)`` (``linear(x)`` for None); for a plain ``nn.Linear``, through its
    ``held_transpose``, and over several rows its bias and ``residual`` added in the matmul
    (``product``)."""
    if type(linear) is not nn.Linear:
        return linear(x) if residual is None else residual + linear(x)
    bias = linear.get("bias")
    add = bias if residual is None else residual if bias is None else residual + bias
    return product(x, held_transpose(linear), add)


def fused(owner: nn.Module) -> FusedLinear | None:
    """``owner``'s fused projections while current (None: none, or stale: run them one by one)."""
    fusion = owner.__dict__.get("_fusion")
    return fusion if fusion is not None and fusion.current() else None


def fuse_projections(network: nn.Module) -> None:
    """Fuse, in every module of ``network`` whose class names ``fused_projections`` (layers that
    read the same input), those layers where they can be (``FusedLinear.of``). Idempotent: a
    module whose fusion is current keeps it."""
    for module in network.modules():
        names = getattr(type(module), "fused_projections", ())
        if names and fused(module) is None:
            # Kept out of the module's parameters (nn.Module keeps arrays, lists and dicts as children).
            object.__setattr__(module, "_fusion", FusedLinear.of([getattr(module, name) for name in names]))
