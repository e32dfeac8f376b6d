"""``butter_core.warm_up``: after a warm-up, generations within its context build no kernel it did not.

Run on the CUDA path without a GPU: ``standing_in_for_gpu`` sends caches down their GPU paths
and ``recorded_builds("cuda")`` records each kernel build (what MLX would compile) instead of
running it, so what a generation would compile is visible on any machine.
"""

from __future__ import annotations

import itertools

import mlx.core as mx
import pytest

from butter_core import LoadOptions, Window, parse_kv_cache
from butter_core.engine import Engine
from butter_core.generation import Generation
from butter_core.kernels import recorded_builds, standing_in_for_gpu
from butter_core.model import Model
from butter_core.plugins import get_plugin_host
from butter_core.testing.tiny_models import TinySpec
from butter_core.warm_up import FIRST_PROBE, probe_lengths, warm_up, warm_up_batched

WIDE = TinySpec(family="qwen3", dtype="bfloat16", head_dim=128, max_position_embeddings=8192)
"""Heads as wide as the GPU kernels' tensor-core paths take (the family's 32 take a fallback)."""


def build_keys(builds) -> set:
    """What MLX compiles a build under: the kernel, its template values and dtypes."""
    return {(b.kernel.name, b.template, b.input_dtypes, b.output_dtypes) for b in builds}


def test_probe_lengths():
    assert probe_lengths(40960) == (4096, 8192, 16384, 32768, 40960)
    assert probe_lengths(8192) == (4096, 8192)
    assert probe_lengths(FIRST_PROBE) == (FIRST_PROBE,)
    assert probe_lengths(1000) == ()


@pytest.mark.parametrize("scheme", ["raw", "affine4", "aura4v2"])
def test_generations_build_nothing_after_warm_up(tiny_model, scheme):
    if scheme.rstrip("0123456789v") not in get_plugin_host().schemes:
        pytest.skip(f"needs the {scheme} scheme installed")
    with standing_in_for_gpu(), recorded_builds("cuda") as builds:
        model = Model.load(tiny_model(WIDE), LoadOptions(kv_cache=parse_kv_cache(scheme)))
        model.engine = Engine(model.network, model.options, prefill_chunk=256)  # the GPU's 2048 is slow on a CPU
        warm = model.engine.prefill_chunk
        done = warm_up(model.engine)
        assert done.probe_lengths == (4096, 8192) and done.prompt_tokens == warm + 8
        warm_up_batched(model.engine)
        warmed = build_keys(builds)
        if scheme != "raw":  # raw runs MLX's own attention; the others their kernels
            assert warmed
        before = len(builds)
        # Decode steps see the allocation a generation reserves (prompt + max_tokens): three
        # steps of each, up to past the largest probe's half, are what it would compile.
        for prompt, max_tokens in ((300, 4), (warm + 40, 3), (10, 5000), (600, 7000)):
            ids = mx.arange(prompt, dtype=mx.uint32) % model.network.args.vocab_size
            generation = Generation(model.engine, ids, model.engine.make_layer_caches(), max_tokens=max_tokens)
            assert len(list(itertools.islice(generation, 3))) == 3
        batch = model.generate_batch(model.engine.make_batched_caches(64 * 64))
        for prompt in (5, 300, 600):
            batch.add(mx.arange(prompt, dtype=mx.uint32) % 97, max_tokens=3)
        assert sum(1 for _ in batch) == 9
        assert builds[before:], "the generations traced nothing: the check would be empty"
        assert build_keys(builds[before:]) <= warmed


def test_warm_up_stays_within_its_context_and_the_caches(tiny_model, raw_scheme):
    model = Model.load(tiny_model(), LoadOptions(kv_cache=parse_kv_cache("raw"), max_context_length=300))
    done = warm_up(model.engine, context=10_000)  # past the caches' 300: bounded by them
    assert done.prompt_tokens == 300 - 3 and done.probe_lengths == ()


@pytest.mark.parametrize("family", ["granitemoehybrid", "mamba2", "nemotron_h", "qwen3_next"])
def test_hybrid_families_warm_up_every_layer_type(family_model, raw_scheme, family):
    if "ssm" not in get_plugin_host().schemes:
        pytest.skip("needs the ssm state cache scheme (pip install butter-ssm)")
    model = Model.load(family_model(family), LoadOptions(kv_cache=parse_kv_cache("raw")))
    context = model.network.args.max_position_embeddings
    assert warm_up(model.engine).prompt_tokens == min(model.engine.prefill_chunk + 8, context - 3)
    assert warm_up_batched(model.engine) > 0


def test_a_window_is_probed_no_further_than_it_holds(tiny_model, raw_scheme):
    spec = TinySpec(family="qwen3", max_position_embeddings=20_000)
    options = LoadOptions(kv_cache=parse_kv_cache("raw"), kv_eviction=Window(5000, keep=4), prefill_chunk=512)
    windowed = Model.load(tiny_model(spec), options)  # a GPU's default chunk (8192) would cover every probe
    assert warm_up(windowed.engine).probe_lengths == (4096, 5000)
    assert warm_up_batched(windowed.engine) > 0
