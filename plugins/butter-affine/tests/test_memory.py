"""On the CPU the dequantize working set of a many-layer forward is one layer's, not all layers'.

The seed shares one pair of dequantize buffers between all layers of a model. In MLX a
kernel output is a fresh array and the allocator recycles a buffer once the last array
using it is gone; layer n's dequantized K/V die when its attention has run, so layer
n + 1 reuses their memory. This measures it: a 16-token chunk through 30 layers that
each hold 2048 positions, evaluated as one graph, as a model's forward is. (On CUDA
the same graph keeps ~20 layers' worth alive; ``butter_core.working_set`` says why and
how ``PrefillPipeline`` bounds it; ``bench/gpu_affine.py`` measures both.)
"""

import gc

import mlx.core as mx
import pytest

from butter_core import LayerSpec, make_layer_caches, parse_kv_cache

LAYERS, LIVE, CHUNK, KV_HEADS, Q_HEADS, HEAD_DIM = 30, 2048, 16, 2, 4, 64


def working_set(kind: str, layers: int = LAYERS) -> int:
    """Peak bytes in use beyond what is held once one chunked-prefill step is done."""
    specs = [LayerSpec(n_kv_heads=KV_HEADS, head_dim=HEAD_DIM, max_positions=LIVE + 256, layer_index=i)
             for i in range(layers)]
    caches = make_layer_caches(parse_kv_cache(kind), specs)
    for i, cache in enumerate(caches):
        keys = mx.random.normal((1, KV_HEADS, LIVE + 240, HEAD_DIM), key=mx.random.key(i))
        cache.append(keys, keys * 0.5)  # 2288 slots: the chunk below needs no growth
        cache.trim(240)
        mx.eval(cache.buffers())
    h = mx.random.normal((1, Q_HEADS, CHUNK, HEAD_DIM), key=mx.random.key(99))
    mx.eval(h)
    gc.collect()
    mx.reset_peak_memory()
    for cache in caches:
        h = h + cache.update_and_attend(h, h[:, :KV_HEADS], h[:, KV_HEADS:], scale=HEAD_DIM**-0.5)
    mx.eval(h, [cache.buffers() for cache in caches])
    return mx.get_peak_memory() - mx.get_active_memory()


@pytest.mark.skipif(mx.default_device() == mx.gpu, reason="a CPU property: on a GPU MLX keeps more layers' "
                    "intermediates alive and PrefillPipeline bounds them (butter_core.working_set)")
@pytest.mark.parametrize("kind", ["affine4", "affine8"])
def test_working_set_is_one_layer(kind):
    """It does not grow with the number of layers, and stays within one layer's
    dequantize intermediates (the pure-mx dequantize's unpacked codes, the float32 K and
    V, SDPA's scores)."""
    one_layer = 2 * KV_HEADS * (LIVE + CHUNK) * HEAD_DIM * 4  # dequantized float32 K and V
    few, many = working_set(kind, layers=5), working_set(kind)
    print(f"{kind}: working set {many / 2**20:.2f} MiB with {LAYERS} layers, {few / 2**20:.2f} MiB with 5; "
          f"one layer's dequantized K/V {one_layer / 2**20:.2f} MiB, all {LAYERS} layers' "
          f"{LAYERS * one_layer / 2**20:.0f} MiB")
    assert many == pytest.approx(few, rel=0.1)
    assert many < 3 * one_layer
