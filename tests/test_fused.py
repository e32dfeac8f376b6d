"""Fused projections (``butter_core.models.fused``) on tiny models loaded through the real loader:
the same outputs, the same parameters, one copy of the weights, never a stale fusion."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from butter_core.loading.weights import WeightOptions, load_network
from butter_core.model import Model
from butter_core.models.base import MLP, Attention, swiglu
from butter_core.models.fused import FusedLinear, fuse_projections, fused, held_transpose, plus
from butter_core.testing.tiny_models import TinySpec


def unfused_network(path):
    """The network as loaded, before an engine fuses it."""
    network, _ = load_network(path, WeightOptions())
    return network


def fusions(network) -> list:
    return [fused(m) for m in network.modules() if isinstance(m, Attention | MLP)]


def test_loaded_model_is_fused_with_its_parameters_unchanged(tiny_model, family, raw_scheme):
    path = tiny_model(TinySpec(family=family))
    plain = dict(tree_flatten(unfused_network(path).parameters()))
    model = Model.load(str(path))
    assert all(f is not None for f in fusions(model.network))
    params = dict(tree_flatten(model.network.parameters()))
    assert params.keys() == plain.keys()
    for name, array in params.items():
        assert mx.array_equal(array, plain[name]), name
    # One copy: each layer's weight is a view of its block of the fused weight.
    attention = model.network.layers[0].self_attn
    assert attention.k_proj.weight.shape == plain["model.layers.0.self_attn.k_proj.weight"].shape
    assert fused(attention).weight.shape[0] == sum(getattr(attention, n).weight.shape[0] for n in Attention.fused_projections)


@pytest.mark.parametrize("tokens", [1, 5])
def test_fused_forward_equals_unfused(tiny_model, family, tokens):
    path = tiny_model(TinySpec(family=family))
    plain, network = unfused_network(path), unfused_network(path)
    fuse_projections(network)
    ids = mx.array([[3, 1, 4, 1, 5][:tokens]])
    assert mx.allclose(network(ids), plain(ids), atol=1e-5, rtol=1e-5)


def test_a_replaced_weight_ends_the_fusion(tiny_model):
    path = tiny_model(TinySpec())
    network = unfused_network(path)
    fuse_projections(network)
    attention, mlp = network.layers[0].self_attn, network.layers[0].mlp
    attention.k_proj.weight = mx.zeros_like(attention.k_proj.weight)
    mlp.update({"up_proj": {"weight": mx.ones_like(mlp.up_proj.weight)}})
    assert fused(attention) is None and fused(mlp) is None
    x = mx.random.normal((1, 1, network.args.hidden_size))
    _, k, _ = attention.project(x)
    assert mx.array_equal(k, mx.zeros_like(k))  # the new weight, not the fused copy's
    assert mx.allclose(mlp(x), mlp.down_proj(swiglu(mlp.gate_proj(x), mlp.up_proj(x))), atol=1e-5)
    fuse_projections(network)  # fusing again takes the new weights
    assert fused(attention) is not None and mx.array_equal(attention.project(x)[1], k)


def test_only_plain_linears_of_one_input_size_fuse():
    holder = nn.Module()
    holder.a, holder.b = nn.Linear(64, 32), nn.Linear(64, 32)
    nn.quantize(holder, group_size=32, bits=4)
    assert FusedLinear.of([holder.a, holder.b]) is None
    assert FusedLinear.of([nn.Linear(64, 32), nn.Linear(48, 32)]) is None
    assert FusedLinear.of([nn.Linear(64, 32), nn.Linear(64, 32, bias=False)]) is None
    with_bias = [nn.Linear(64, 32), nn.Linear(64, 16)]
    xs = [mx.random.normal((2, 3, 64)), mx.random.normal((1, 1, 64))]  # several rows, one row
    expected = [[linear(x) for linear in with_bias] for x in xs]
    fusion = FusedLinear.of(with_bias)
    assert fusion is not None and fusion.current()
    for x, wanted in zip(xs, expected):
        for got, want, linear in zip(fusion(x), wanted, with_bias):
            assert mx.allclose(got, want, atol=1e-5) and mx.allclose(linear(x), want, atol=1e-5)


def test_swiglu_is_silu_times_up():
    gate, up = mx.random.normal((2, 5, 8)), mx.random.normal((2, 5, 8))
    assert mx.allclose(swiglu(gate, up), nn.silu(gate) * up, atol=1e-6)
    whole = mx.random.normal((3, 16))  # strided halves, as a fused gate/up gives them
    assert mx.allclose(swiglu(whole[:, :8], whole[:, 8:]), nn.silu(whole[:, :8]) * whole[:, 8:], atol=1e-6)


@pytest.mark.parametrize("kind", ["plain", "bias", "quantized"])
def test_plus_adds_the_projection_to_the_residual(kind):
    holder = nn.Module()
    holder.linear = nn.Linear(64, 32, bias=kind == "bias")
    if kind == "quantized":
        nn.quantize(holder, group_size=32, bits=4)
    for rows in ((2, 3), (4, 1), (1, 1)):  # several rows (one addmm), a batch of single rows, one row
        x, residual = mx.random.normal((*rows, 64)), mx.random.normal((*rows, 32))
        assert mx.allclose(plus(holder.linear, x, residual), residual + holder.linear(x), atol=1e-5)
        assert mx.array_equal(plus(holder.linear, x, None), holder.linear(x))


def test_a_held_transpose_follows_its_weight_and_leaves_the_product_alone_in_the_graph(tmp_path):
    holder = nn.Module()
    holder.linear = nn.Linear(64, 32, bias=False)
    rows = mx.random.normal((4, 64))
    mx.eval(rows, holder.parameters())
    out = plus(holder.linear, rows)
    mx.export_to_dot(str(tmp_path / "product.dot"), out)
    graph = (tmp_path / "product.dot").read_text()
    assert graph.count("shape=rectangle") == 1 and 'label ="Matmul"' in graph  # no Transpose: it reads the held one
    assert mx.array_equal(out, holder.linear(rows))
    held = held_transpose(holder.linear)
    assert held_transpose(holder.linear) is held
    holder.update({"linear": {"weight": mx.ones_like(holder.linear.weight)}})  # as load_weights replaces it
    assert held_transpose(holder.linear) is not held
    assert mx.allclose(plus(holder.linear, rows), rows.sum(axis=1, keepdims=True) * mx.ones((1, 32)), atol=1e-5)  # the new weight
