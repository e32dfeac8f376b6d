"""``butter_core.warm_up`` meets the tensor-core decode's long-run variant before a generation does.

``decode_mma`` takes ``LONG_KEY_BLOCKS`` where each warp walks ``LONG_RUN`` keys or more of
the allocation: a new kernel build the first time a longer request arrives. On the CUDA path
without a GPU (``standing_in_for_gpu``, builds recorded instead of compiled), a tiny model
with bfloat16 heads of 128 (two KV heads, so the switch falls near 204k slots)."""

import itertools

import mlx.core as mx

from butter_core import LoadOptions, parse_kv_cache
from butter_core.generation import Generation
from butter_core.kernels import recorded_builds, standing_in_for_gpu
from butter_core.model import Model
from butter_core.testing.tiny_models import TinySpec, write_tiny_model
from butter_core.warm_up import warm_up

from butter_affine.kernels.decode_mma import KEY_BLOCKS, LONG_KEY_BLOCKS

CONTEXT = 262144
LONG_ALLOCATION = 230_000
"""A generation's prompt + max_tokens past the switch, below ``CONTEXT``."""


def key_blocks(builds) -> set[int]:
    return {dict(b.template)["KB"] for b in builds if b.kernel.name == "butter_affine_stacked_decode_mma_partials"}


def test_warm_up_builds_the_long_run_variant_a_long_generation_uses(tmp_path):
    directory = write_tiny_model(tmp_path, TinySpec(family="qwen3", dtype="bfloat16", head_dim=128,
                                                    max_position_embeddings=CONTEXT))  # fmt: skip
    with standing_in_for_gpu(), recorded_builds("cuda") as builds:
        model = Model.load(directory, LoadOptions(kv_cache=parse_kv_cache("affine4")))
        warm_up(model.engine, context=CONTEXT // 2)  # short of the switch
        assert key_blocks(builds) == {KEY_BLOCKS}
        warm_up(model.engine)  # the whole context
        assert key_blocks(builds) == {KEY_BLOCKS, LONG_KEY_BLOCKS[4]}
        warmed = {(b.kernel.name, b.template) for b in builds}
        before = len(builds)
        generation = Generation(model.engine, mx.arange(10, dtype=mx.uint32), model.engine.make_layer_caches(),
                                max_tokens=LONG_ALLOCATION - 10)  # fmt: skip
        assert len(list(itertools.islice(generation, 3))) == 3
        assert key_blocks(builds[before:]) == {LONG_KEY_BLOCKS[4]}  # the variant it runs: built by the warm-up
        assert {(b.kernel.name, b.template) for b in builds[before:]} <= warmed
