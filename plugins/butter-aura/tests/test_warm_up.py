"""A warm-up decodes as far as the step at which AURA encodes its deferred recent tokens.

A decode step leaves its token's codes for later (``AuraCache.store``); step
``warm_up_steps`` encodes the recent ring's tokens in one call, with shapes no earlier
step ran, so ``butter_core.warm_up`` must get that far. On the CUDA path without a GPU
(``standing_in_for_gpu``, kernel launches recorded instead of run)."""

import mlx.core as mx

from butter_core import LoadOptions, make_layer_caches, parse_kv_cache
from butter_core.cache import LayerSpec
from butter_core.kernels import recorded_builds, standing_in_for_gpu
from butter_core.model import Model
from butter_core.testing.tiny_models import TinySpec, write_tiny_model
from butter_core.warm_up import warm_up


def encodes(builds) -> int:
    return sum(1 for b in builds if b.kernel.name.startswith("butter_aura_encode"))


def test_the_deferred_encode_comes_due_at_warm_up_steps():
    spec = LayerSpec(2, 128, 512, mx.bfloat16)
    with standing_in_for_gpu(), recorded_builds("cuda") as builds:
        cache = make_layer_caches(parse_kv_cache("aura4v2"), [spec])[0]
        assert cache.warm_up_steps == cache.budget.ring + 1
        prompt = mx.random.normal((1, 2, 40, 128)).astype(mx.bfloat16)
        cache.append(prompt, prompt)
        assert encodes(builds) == 1
        token = prompt[:, :, :1]
        queries = mx.concatenate([token, token], axis=1)
        for step in range(1, cache.warm_up_steps + 1):
            before = encodes(builds)
            mx.eval(cache.update_and_attend(queries, token, token, scale=0.1))
            assert encodes(builds) - before == (step == cache.warm_up_steps), step


def test_warm_up_decodes_through_the_deferred_encode(tmp_path):
    directory = write_tiny_model(tmp_path, TinySpec(family="qwen3", dtype="bfloat16", head_dim=128))
    with standing_in_for_gpu(), recorded_builds("cuda"):
        model = Model.load(directory, LoadOptions(kv_cache=parse_kv_cache("aura4v2"), max_context_length=500))
        steps = model.engine.make_layer_caches()[0].warm_up_steps
        done = warm_up(model.engine)
    assert done.decode_steps == steps > 3
    assert done.prompt_tokens + steps <= 500
