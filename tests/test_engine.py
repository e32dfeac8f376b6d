"""Engine API: samplers, forward_sample's position check, generation stats, multi-turn cache reuse."""

import mlx.core as mx
import numpy as np
import pytest

from butter_core.config import LoadOptions, Window
from butter_core.engine import (
    LARGE_PREFILL_CHUNK,
    PREFILL_CHUNK,
    ContextLengthError,
    Engine,
    PositionError,
    TokenIdError,
    default_prefill_chunk,
)
from butter_core.errors import ConfigError
from butter_core.generation import Generation
from butter_core.kernels import recorded_builds, standing_in_for_gpu
from butter_core.model import Model
from butter_core.sampling import Sampler
from butter_core.serving.server import device_memory
from butter_core.testing.recompute import greedy_recompute
from butter_core.testing.tiny_models import TinySpec

LOGITS = mx.array([2.0, 1.5, 0.1, -1.0, -3.0])


@pytest.fixture
def model(tiny_model, family):
    return Model.load(str(tiny_model(TinySpec(family=family))))


def draws(sampler, n=200):
    return [sampler(LOGITS).item() for _ in range(n)]


def test_greedy_is_argmax():
    assert draws(Sampler(), 5) == [0] * 5


def test_seeded_sampling_is_reproducible():
    assert draws(Sampler(temperature=1.0, seed=7)) == draws(Sampler(temperature=1.0, seed=7))
    assert draws(Sampler(temperature=1.0, seed=7)) != draws(Sampler(temperature=1.0, seed=8))


def test_temperature_sampling_follows_the_softmax():
    counts = np.bincount(draws(Sampler(temperature=1.0, seed=0), 2000), minlength=5) / 2000
    expected = np.array(mx.softmax(LOGITS))
    assert np.abs(counts - expected).max() < 0.05


def test_top_p_keeps_the_smallest_set_reaching_p():
    # softmax(LOGITS) ~ [0.55, 0.33, 0.08, 0.03, 0.004]: p=0.8 keeps the first two tokens.
    assert set(draws(Sampler(temperature=1.0, top_p=0.8, seed=1))) == {0, 1}
    assert set(draws(Sampler(temperature=1.0, top_p=0.01, seed=1))) == {0}


@pytest.mark.parametrize(
    "kwargs, flag",
    [({"temperature": -1}, "--temp"), ({"temperature": float("nan")}, "--temp"), ({"top_p": 0}, "--top-p"),
     ({"top_p": 1.5}, "--top-p"), ({"seed": -3}, "--seed")],
)  # fmt: skip
def test_invalid_sampler_parameters_name_their_flag(kwargs, flag):
    with pytest.raises(ConfigError, match=flag):
        Sampler(**kwargs)


@pytest.mark.usefixtures("raw_scheme")
def test_forward_sample_checks_the_position(model):
    caches = model.engine.make_layer_caches()
    first = model.engine.forward_sample(5, 0, caches)
    with pytest.raises(PositionError, match="next token goes at position 1"):
        model.engine.forward_sample(first, 0, caches)
    with pytest.raises(PositionError):
        model.engine.forward_sample(first, 2, caches)
    assert isinstance(model.engine.forward_sample(first, 1, caches), int)


@pytest.mark.usefixtures("raw_scheme")
def test_caches_must_match_the_layers(model):
    with pytest.raises(ConfigError, match="make them with engine.make_layer_caches"):
        model.engine.forward([1, 2], model.engine.make_layer_caches()[:1])


@pytest.mark.usefixtures("raw_scheme")
def test_respond_reuses_caches_across_turns(model):
    """The seed's ``respond`` example, in Python: the position carries across calls."""
    engine, tokenizer = model.engine, model.tokenizer
    caches = engine.make_layer_caches()
    stop = tokenizer.eos_token_ids

    def respond(prompt: str, position: int, limit: int = 6) -> tuple[list[int], int]:
        pos = position
        next_token = 0
        for t in tokenizer.encode(prompt):
            next_token = engine.forward_sample(t, pos, caches)
            pos += 1
        generated = []
        while next_token not in stop and len(generated) < limit:
            generated.append(next_token)
            next_token = engine.forward_sample(next_token, pos, caches)
            pos += 1
        return generated, pos

    first, position = respond("The quick brown fox", 0)
    second, position = respond(" jumps over", position)
    history = tokenizer.encode("The quick brown fox") + first
    assert first == greedy_recompute(model.network, tokenizer.encode("The quick brown fox"), len(first))[0]
    assert second == greedy_recompute(model.network, history + tokenizer.encode(" jumps over"), len(second))[0]
    assert position == caches[0].absolute_position == len(history) + len(tokenizer.encode(" jumps over")) + len(second)


@pytest.mark.usefixtures("raw_scheme")
def test_generation_continues_where_the_caches_left_off(model):
    caches = model.engine.make_layer_caches()
    prompt = model.encode_prompt("Once upon a time")
    first = list(model.generate(prompt, caches, max_tokens=5, stop_ids=()))
    assert caches[0].absolute_position == len(prompt) + 5  # every sampled token is in the caches
    follow_up = model.encode_prompt(" there was")
    second = list(model.generate(follow_up, caches, max_tokens=4, stop_ids=()))
    assert second == greedy_recompute(model.network, prompt + first + follow_up, 4)[0]


@pytest.mark.usefixtures("raw_scheme")
def test_generation_stats_and_stop_ids(model):
    prompt = model.encode_prompt("What is the capital of France?")
    greedy = list(model.generate(prompt, max_tokens=6, stop_ids=()))
    stopped = model.generate(prompt, max_tokens=6, stop_ids={greedy[2]})
    assert list(stopped) == greedy[:2]
    stats = stopped.stats
    assert stats.finish_reason == "stop" and stats.generated_tokens == 3 and stats.prompt_tokens == len(prompt)
    assert stats.prompt_tps > 0 and stats.decode_tps > 0 and stats.peak_memory > 0
    assert 0 < stats.kv_bytes_live <= stats.kv_bytes_allocated
    assert "tok/s" in stats.summary() and "peak memory" in stats.summary()


@pytest.mark.usefixtures("raw_scheme")
def test_seeded_generation_is_reproducible(model):
    prompt = model.encode_prompt("Butter melts")

    def sample(seed):
        return list(model.generate(prompt, sampler=Sampler(temperature=1.0, top_p=0.9, seed=seed), max_tokens=10, stop_ids=()))

    assert sample(3) == sample(3)
    assert sample(3) != sample(4)


@pytest.mark.usefixtures("raw_scheme")
def test_generation_runs_once_and_validates_max_tokens(model):
    generation = Generation(model.engine, [1, 2, 3], model.engine.make_layer_caches(), max_tokens=2)
    list(generation)
    with pytest.raises(RuntimeError):
        list(generation)
    with pytest.raises(ConfigError, match="--max-tokens"):
        Generation(model.engine, [1], model.engine.make_layer_caches(), max_tokens=0)


@pytest.mark.usefixtures("raw_scheme")
@pytest.mark.parametrize(
    "ids, message",
    [
        ([10**9], "token id 1000000000 is out of range: this model's ids are 0..383"),
        ([3, -1], "token id -1 is out of range"),
        (mx.array([384], dtype=mx.int32), "token id 384 is out of range"),
        ([1.5], r"token ids must be integers; got \[1.5\] \(float64\)"),
        (mx.array([1.0, 2.0]), "token ids must be integers"),
        ([True], "token ids must be integers"),
        ("12", "token ids must be integers"),
        ([[1, 2], [3, 4]], r"one sequence \(a list or 1-D array\), got shape \[2, 2\]"),
        (mx.array([[1, 2]]), r"got shape \[1, 2\]"),
        ([[1], [2, 3]], "one sequence of integers"),
        ([], "at least one token id"),
    ],
)  # fmt: skip
def test_bad_token_ids_are_named_and_nothing_is_appended(model, ids, message):
    caches = model.engine.make_layer_caches()
    with pytest.raises(TokenIdError, match=message):
        model.engine.forward(ids, caches)
    assert caches[0].absolute_position == 0


@pytest.mark.usefixtures("raw_scheme")
def test_a_forward_that_does_not_fit_appends_nothing(tiny_model):
    model = Model.load(str(tiny_model(TinySpec())), LoadOptions(max_context_length=16))
    caches = model.engine.make_layer_caches()
    model.engine.forward(list(range(10)), caches)
    with pytest.raises(ContextLengthError, match="7 token ids need 17 positions after the 10 positions the caches "
                       r"already hold, but the KV cache holds 16 \(--max-context 16"):  # fmt: skip
        model.engine.forward(list(range(7)), caches)
    assert [cache.absolute_position for cache in caches] == [10, 10]
    model.engine.forward(list(range(6)), caches)  # exactly full


@pytest.mark.usefixtures("raw_scheme")
def test_generation_checks_prompt_plus_max_tokens_before_prefill(tiny_model):
    model = Model.load(str(tiny_model(TinySpec())), LoadOptions(max_context_length=16))
    caches = model.engine.make_layer_caches()
    with pytest.raises(ContextLengthError, match="the prompt's 10 tokens and --max-tokens 7 need 17 positions"):
        model.generate(list(range(10)), caches, max_tokens=7)
    assert caches[0].absolute_position == 0
    assert len(list(model.generate(list(range(10)), caches, max_tokens=6, stop_ids=()))) == 6
    with pytest.raises(ConfigError, match="the prompt is empty"):
        model.generate([], max_tokens=2)


@pytest.mark.usefixtures("raw_scheme")
def test_window_eviction_leaves_room_for_any_length(tiny_model):
    options = LoadOptions(max_context_length=16, kv_eviction=Window(8, keep=2))
    model = Model.load(str(tiny_model(TinySpec())), options)
    caches = model.engine.make_layer_caches()
    assert len(list(model.generate(list(range(20)), caches, max_tokens=30, stop_ids=()))) == 30


@pytest.mark.usefixtures("raw_scheme")
def test_prefill_reports_progress_after_each_chunk_but_the_last(model):
    engine = Engine(model.network, model.options, prefill_chunk=4)
    seen = []
    mx.eval(engine.forward(list(range(10)), engine.make_layer_caches(), progress=lambda *done: seen.append(done)))
    assert seen == [(4, 10), (8, 10)]


@pytest.mark.parametrize(("backend", "info", "chunk"), [
    ("cuda", {}, PREFILL_CHUNK["gpu"]),  # no memory reported
    ("cuda", {"total_memory": 80 * 2**30}, LARGE_PREFILL_CHUNK),
    ("cuda", {"total_memory": 24 * 2**30}, PREFILL_CHUNK["gpu"]),
    ("metal", {"memory_size": 128 * 2**30}, PREFILL_CHUNK["gpu"]),  # not measured on Metal: mlx-lm's 2048
])  # fmt: skip
def test_default_prefill_chunk_by_device_and_memory(monkeypatch, backend, info, chunk):
    assert default_prefill_chunk() == PREFILL_CHUNK["cpu"]
    monkeypatch.setattr(mx, "device_info", lambda: {"device_name": "a GPU", **info})
    with standing_in_for_gpu(), recorded_builds(backend):
        assert default_prefill_chunk() == chunk
        if info:  # butter serve's default --kv-memory is a share of the GPU's memory, not the host's
            assert device_memory() == next(iter(info.values()))


@pytest.mark.usefixtures("raw_scheme")
def test_load_options_prefill_chunk_reaches_the_engine(tiny_model):
    model = Model.load(str(tiny_model(TinySpec())), LoadOptions(prefill_chunk=64))
    assert model.engine.prefill_chunk == 64
    assert Engine(model.network, model.options, prefill_chunk=8).prefill_chunk == 8  # the argument wins
    with pytest.raises(ConfigError, match=r"LoadOptions.prefill_chunk must be a positive integer, got 0"):
        LoadOptions(prefill_chunk=0)
