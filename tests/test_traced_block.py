"""A decoder block's decode step through its two traces (``butter_core.models.traced``), on tiny
models loaded through the real loader: the outputs of the block run op by op, and never a
stale weight."""

from __future__ import annotations

import mlx.core as mx
import pytest

from butter_core.model import Model
from butter_core.models import traced
from butter_core.testing.tiny_models import TinySpec
from butter_core.warm_up import warm_up

PROMPT = mx.array([3, 1, 4, 1, 5, 9, 2, 6], dtype=mx.uint32)


def op_by_op(block, x, cache):
    """What ``Block.__call__`` computes without its traces."""
    h = block.self_attn(block.input_layernorm(x), cache, residual=x)
    return block.mlp(block.post_attention_layernorm(h), residual=h)


def prefilled(model: Model):
    caches = model.engine.make_layer_caches()
    mx.eval(model.engine.forward(PROMPT, caches))
    return caches


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_traced_decode_step_equals_the_block_run_op_by_op(tiny_model, family, raw_scheme, dtype):
    model = Model.load(str(tiny_model(TinySpec(family=family))))
    model.network.set_dtype(getattr(mx, dtype))
    traced_caches, plain_caches = prefilled(model), prefilled(model)
    x = mx.random.normal((1, 1, model.network.args.hidden_size), key=mx.random.key(1)).astype(getattr(mx, dtype))
    steps = traced.AFTER + 2  # op by op until the AFTER-th call traces; the rest replay
    for step in range(steps):
        for block, traced_cache, plain_cache in zip(model.network.layers, traced_caches, plain_caches):
            assert block.traced_decode(x, traced_cache) is not None
            got, want = block(x, traced_cache), op_by_op(block, x, plain_cache)
            assert got.dtype == want.dtype
            assert mx.allclose(got, want, atol=1e-6, rtol=1e-6).item(), (family, dtype, step)
            x = want
    assert traced_caches[0].absolute_position == PROMPT.size + steps
    assert all(len(block.traced_decode(x, cache).before.traces) == 1 for block, cache in zip(model.network.layers, traced_caches))


def test_a_weight_replaced_after_tracing_is_read(tiny_model, raw_scheme):
    model = Model.load(str(tiny_model(TinySpec())))
    block = model.network.layers[0]
    caches = prefilled(model)
    x = mx.random.normal((1, 1, model.network.args.hidden_size), key=mx.random.key(2))
    step = block.traced_decode(x, caches[0])
    for _ in range(traced.AFTER):
        mx.eval(block(x, caches[0]))
    assert len(step.before.traces) == len(step.after.traces) == 1
    assert block.traced_decode(x, caches[0]) is step  # unchanged weights: the same traces
    for replace in (
        lambda: setattr(block.mlp.down_proj, "weight", block.mlp.down_proj.weight * 2),
        lambda: block.self_attn.update({"k_proj": {"weight": mx.zeros_like(block.self_attn.k_proj.weight)}}),
        lambda: model.network.load_weights([("model.layers.0.input_layernorm.weight", block.input_layernorm.weight + 1)], strict=False),
    ):
        replace()
        assert block.traced_decode(x, caches[0]) is not step
        traced_cache, plain_cache = prefilled(model)[0], prefilled(model)[0]
        for _ in range(traced.AFTER + 1):  # past the call that traces the new weights
            got, want = block(x, traced_cache), op_by_op(block, x, plain_cache)
            assert mx.allclose(got, want, atol=1e-6, rtol=1e-6).item()
        step = block.traced_decode(x, caches[0])
        assert len(step.before.traces) == 1


def test_only_one_token_per_sequence_through_a_cache_is_traced(tiny_model, raw_scheme):
    model = Model.load(str(tiny_model(TinySpec())))
    block, cache = model.network.layers[0], prefilled(model)[0]
    hidden = model.network.args.hidden_size
    assert block.traced_decode(mx.zeros((1, 2, hidden)), cache) is None  # a prefill chunk
    assert block.traced_decode(mx.zeros((1, 1, hidden)), None) is None  # a recompute without caches
    assert block.traced_decode(mx.zeros((3, 1, hidden)), cache) is not None  # a batch's decode step


@pytest.mark.parametrize("after", [traced.AFTER, 5])
def test_a_warm_up_leaves_one_sequence_s_step_traced(tiny_model, raw_scheme, monkeypatch, after):
    monkeypatch.setattr(traced, "AFTER", after)  # a policy set after import is the one warmed up
    model = Model.load(str(tiny_model(TinySpec())))
    warm_up(model.engine, 64)
    hidden = model.network.args.hidden_size
    for block in model.network.layers:
        step = block.traced_decode(mx.zeros((1, 1, hidden)), model.engine.make_layer_caches()[0])
        assert [shapes[0] for shapes in step.before.traces] == [(1, 1, hidden)]
        assert len(step.after.traces) == 1


def test_a_dropped_traced_step_is_made_anew(tiny_model, raw_scheme):
    model = Model.load(str(tiny_model(TinySpec())))
    block, cache = model.network.layers[0], prefilled(model)[0]
    x = mx.zeros((1, 1, model.network.args.hidden_size))
    assert block.traced_step is None
    step = block.traced_decode(x, cache)
    assert block.traced_step is step
    block.drop_traced_step()
    assert block.traced_step is None
    assert block.traced_decode(x, cache) is not step
