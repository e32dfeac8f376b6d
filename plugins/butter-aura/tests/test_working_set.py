"""butter-aura's caches share one ``PrefillPipeline`` (``butter_core.working_set``), as butter-affine's
do: on a GPU a prefill's decoded K/V then live for a few layers at a time, not for most of them."""

import mlx.core as mx

from butter_core import LayerSpec, make_layer_caches, parse_kv_cache
from butter_core.kernels import standing_in_for_gpu

LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM = 4, 2, 4, 64


def test_a_models_caches_share_one_pipeline_that_takes_multi_token_attention_only():
    specs = [LayerSpec(n_kv_heads=KV_HEADS, head_dim=HEAD_DIM, max_positions=512, layer_index=i) for i in range(LAYERS)]
    caches = make_layer_caches(parse_kv_cache("aura4v2"), specs)
    pipeline = caches[0].pipeline
    assert pipeline is not None and all(cache.pipeline is pipeline for cache in caches)
    chunk = mx.random.normal((1, Q_HEADS, 40, HEAD_DIM), key=mx.random.key(0))
    with standing_in_for_gpu():  # the pipeline submits only where the default device is a GPU
        outputs = [cache.update_and_attend(chunk, chunk[:, :KV_HEADS], chunk[:, KV_HEADS:], scale=HEAD_DIM**-0.5)
                   for cache in caches]  # fmt: skip
        assert list(pipeline._in_flight) == outputs[-pipeline.depth:]  # the older ones were waited for
        token = chunk[:, :, :1]
        caches[0].update_and_attend(token, token[:, :KV_HEADS], token[:, KV_HEADS:], scale=HEAD_DIM**-0.5)
        assert list(pipeline._in_flight) == outputs[-pipeline.depth:]  # a decode step does not go through it
