"""A decoder block's decode step and an AURA cache's as one trace (core's ``TracedDecode.with_cache``),
on a tiny Qwen3 model loaded through the real loader, its kernels run by the CUDA emulator: the
outputs and cache state of the block run op by op (``test_kernels`` takes a cache's traced step
through the ring's deferred encode)."""

import mlx.core as mx
import pytest

from butter_core import LoadOptions, parse_kv_cache
from butter_core.kernels import standing_in_for_gpu
from butter_core.kernels.cuda_emulator import emulated_cuda
from butter_core.kernels.metal_emulator import compiler_available
from butter_core.model import Model
from butter_core.models import traced
from butter_core.testing.tiny_models import TinySpec, write_tiny_model

from butter_aura.kernels import attention


def op_by_op(block, x, cache):
    """What ``Block.__call__`` computes without its traces (the cache's own step still traced)."""
    h = block.self_attn(block.input_layernorm(x), cache, residual=x)
    return block.mlp(block.post_attention_layernorm(h), residual=h)


@pytest.mark.skipif(not compiler_available(), reason="the CUDA emulator needs g++ 12+ (_Float16)")
def test_a_block_and_its_aura_cache_step_as_one_trace_equal_the_block_run_op_by_op(tmp_path):
    directory = write_tiny_model(tmp_path, TinySpec(family="qwen3", dtype="bfloat16", head_dim=64))
    prompt = mx.array([3, 1, 4, 1, 5, 9, 2, 6], dtype=mx.uint32)
    with standing_in_for_gpu(), emulated_cuda():
        attention.step_function.cache_clear()
        model = Model.load(directory, LoadOptions(kv_cache=parse_kv_cache("aura4v2"), max_context_length=128))
        fused_caches, plain_caches = (model.engine.make_layer_caches() for _ in range(2))
        for caches in (fused_caches, plain_caches):
            mx.eval(model.engine.forward(prompt, caches))
        x = mx.random.normal((1, 1, model.network.args.hidden_size), key=mx.random.key(1)).astype(mx.bfloat16)
        steps = traced.AFTER + 2  # op by op until the AFTER-th call traces; the rest replay
        for step in range(steps):
            for block, fused_cache, plain_cache in zip(model.network.layers, fused_caches, plain_caches):
                got, want = block(x, fused_cache), op_by_op(block, x, plain_cache)
                assert mx.allclose(got, want, atol=2e-2, rtol=2e-2).item(), step
                x = want
        cache = fused_caches[0]
        function = attention.step_function(cache.key_codec.fields, cache.value_codec.fields, cache.budget,
                                           model.network.layers[0].self_attn.scale)  # fmt: skip
        whole = model.network.layers[0].traced_decode(x, cache).with_cache(function)
        assert len(whole.traces) == 1 and whole.made == 1  # traced at step AFTER and replayed since
        for fused, plain in zip(fused_caches, plain_caches):
            assert fused.length == plain.length == prompt.size + steps
            for name, array in fused.state().items():
                assert mx.allclose(array, plain.state()[name], atol=2e-2, rtol=2e-2).item(), name
