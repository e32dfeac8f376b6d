"""Batched storage and continuous batching: every attention scheme, against the single-sequence engine."""

from __future__ import annotations

import functools

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from butter_core import ConfigError, LoadOptions, Window
from butter_core.batch_generation import BatchGeneration, Token, gathered, sample_rows
from butter_core.batched import OutOfPagesError, StaleSequenceError, capacity_for
from butter_core.cache import ATTENTION
from butter_core.engine import ContextLengthError
from butter_core.model import Model
from butter_core.plugins import get_plugin_host
from butter_core.sampling import Sampler
from butter_core.testing.fixtures import example_kind, example_model
from butter_core.testing.tiny_models import TinySpec, write_tiny_model

SCHEMES = sorted(name for name, r in get_plugin_host().schemes.items() if ATTENTION in r.scheme.layer_types)
"""Every attention scheme installed: each runs batched (defines ``BufferedSlotCache.encode``/``decode``;
butter-aura adds a ``SequenceState`` for its full-precision rows)."""
PROMPTS = [
    "The quick brown fox",
    "def add(a, b):",
    "Once upon a time there was a tiny model that wrote short stories about a fox",
    "What is the capital of France? Paris is",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("batched"), TinySpec(family="qwen3"))


def _single(model: Model, prompt: list[int], max_tokens: int) -> list[int]:
    return list(model.generate(prompt, max_tokens=max_tokens, stop_ids=()))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_batched_logits_match_single_sequences(model_dir, scheme):
    """Sequences of different lengths decoded in one forward give each the logits its own decode step
    gets alone, to float32 rounding for raw, within the scheme's stated tolerance otherwise."""
    model = example_model(str(model_dir), scheme)
    _, tolerance = example_kind(scheme, 32)
    prompts = [model.encode_prompt(text) for text in PROMPTS]
    caches = model.engine.make_batched_caches(capacity_tokens=512, page_size=8)
    handles = [caches.open() for _ in prompts]
    for handle, prompt in zip(handles, prompts):
        caches.reserve(handle, len(prompt) + 4)
        mx.eval(model.engine.run_batched(mx.array(prompt, dtype=mx.uint32)[None], caches, [handle]))
    nexts = [[7], [11], [13], [17]]
    batched = model.engine.run_batched(mx.array(nexts, dtype=mx.uint32), caches, handles)
    for row, (prompt, nxt) in enumerate(zip(prompts, nexts)):
        caches = model.engine.make_layer_caches()
        mx.eval(model.engine.forward(prompt, caches))
        alone = model.engine.forward(nxt, caches)  # a decode step, as the batched one is
        error = (mx.abs(batched[row] - alone).max() / mx.abs(alone).max()).item()
        bound = 1e-5 if scheme == "raw" else tolerance
        if bound is None:
            pytest.skip(f"{scheme} declares no model_tolerance")
        assert error <= bound, (row, error)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_continuous_batching_gives_each_sequence_its_own_tokens(model_dir, scheme):
    """Joining mid-stream, leaving at different lengths, a slot reused: each sequence's greedy
    tokens are those it generates alone."""
    model = example_model(str(model_dir), scheme)
    prompts = [model.encode_prompt(text) for text in PROMPTS]
    lengths = [12, 5, 9, 7]
    expected = [_single(model, p, n) for p, n in zip(prompts, lengths)]
    caches = model.engine.make_batched_caches(capacity_tokens=256, page_size=8)
    batch = model.generate_batch(caches, prefill_chunk=6)
    got: dict[int, list[int]] = {}
    ids = [batch.add(prompts[0], max_tokens=lengths[0], stop_ids=()),
           batch.add(prompts[1], max_tokens=lengths[1], stop_ids=())]  # fmt: skip
    for sequence_id, token in batch:
        got.setdefault(sequence_id, []).append(token)
        if len(ids) < 4 and sum(map(len, got.values())) >= {2: 4, 3: 9}[len(ids)]:  # two more join mid-stream
            index = len(ids)
            ids.append(batch.add(prompts[index], max_tokens=lengths[index], stop_ids=()))
    assert len(ids) == 4
    assert [got[i] for i in ids] == expected
    assert batch.finish_reasons == dict.fromkeys(ids, "length")
    assert caches.free_pages == caches.num_pages and caches.nbytes_live == 0


@pytest.mark.usefixtures("raw_scheme")
def test_greedy_and_seeded_sequences_sample_as_they_would_alone(model_dir):
    """A step's greedy sequences take their tokens from one argmax over its rows, fed back as one
    array while they alone decode; a seeded sampler beside them draws what it draws alone (its rows
    then sampled one by one), and greedy ones joining and leaving keep their own tokens."""
    model = example_model(str(model_dir), "raw")
    prompts = [model.encode_prompt(text) for text in PROMPTS[:3]]
    seeded = functools.partial(Sampler, temperature=1.0, top_p=0.9, seed=3)
    alone = [_single(model, prompts[0], 9), _single(model, prompts[1], 4),
             list(model.generate(prompts[2], sampler=seeded(), max_tokens=6, stop_ids=()))]  # fmt: skip
    caches = model.engine.make_batched_caches(capacity_tokens=256, page_size=8)
    batch = model.generate_batch(caches, prefill_chunk=64)
    ids = [batch.add(prompts[0], max_tokens=9, stop_ids=()), batch.add(prompts[1], max_tokens=4, stop_ids=())]
    got: dict[int, list[int]] = {}
    for sequence_id, token in batch:
        got.setdefault(sequence_id, []).append(token)
        if len(ids) == 2 and len(got[ids[0]]) == 3:
            ids.append(batch.add(prompts[2], max_tokens=6, sampler=seeded(), stop_ids=()))
    assert [got[i] for i in ids] == alone


def test_a_greedy_step_feeds_its_tokens_back_as_one_array():
    """``gathered``: the rows of one array, all of them in order, are that array (no stack); anything
    else is stacked, scalars and rows alike."""
    tokens = mx.array([5, 6, 7], dtype=mx.uint32)
    rows = [Token(tokens, i) for i in range(3)]
    assert gathered(rows) is tokens
    assert gathered(rows[1:]).tolist() == [6, 7]
    assert gathered([rows[1], Token(mx.array(9, dtype=mx.uint32))]).tolist() == [6, 9]
    assert gathered(sample_rows(mx.array([[0.0, 2.0], [3.0, 1.0]]), [Sampler(), Sampler()])).tolist() == [1, 0]


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("chunk", [6, 64], ids=["chunks-wrap-the-ring", "one-chunk-past-the-window"])
def test_each_sequence_keeps_its_own_window(model_dir, scheme, chunk):
    """Under --kv-window-size each sequence keeps its sinks and newest positions in at most a
    window's pages; chunks that wrap a sequence's ring attend and write as WindowCache does, so
    the tokens are those it generates alone under the same window."""
    kind, _ = example_kind(scheme, 32)
    model = Model.load(str(model_dir), LoadOptions(kv_cache=kind, kv_eviction=Window(16, keep=4)))
    model.engine.prefill_chunk = chunk
    prompts = [model.encode_prompt(text) for text in PROMPTS[:3]]
    alone = [_single(model, p, 20) for p in prompts]
    caches = model.engine.make_batched_caches(capacity_tokens=256, page_size=8)
    assert caches.pages_for(1000) == 2  # the window's 16 slots
    batch = model.generate_batch(caches, prefill_chunk=chunk)
    ids = [batch.add(p, max_tokens=20, stop_ids=()) for p in prompts]
    got: dict[int, list[int]] = {}
    for sequence_id, token in batch:
        got.setdefault(sequence_id, []).append(token)
    assert [got[i] for i in ids] == alone


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("window", [None, Window(40, keep=4)], ids=["no-window", "window"])
def test_long_prompts_prefilled_in_chunks_give_each_sequence_its_own_tokens(model_dir, scheme, window):
    """Prompts of 116 and 130 tokens beside a short one, prefilled 16 tokens a step: longer than
    butter-aura's full-precision rows (4 sinks, 32 recent), so chunks attend to earlier chunks'
    codes and to their own rows as they came, as they do alone."""
    kind, _ = example_kind(scheme, 32)
    model = Model.load(str(model_dir), LoadOptions(kv_cache=kind, kv_eviction=window))
    model.engine.prefill_chunk = 16
    texts = [PROMPTS[2] + " " + PROMPTS[2] + " and a dog and a cat", PROMPTS[1] * 6, PROMPTS[0]]
    prompts = [model.encode_prompt(text) for text in texts]
    alone = [_single(model, p, 24) for p in prompts]
    batch = model.generate_batch(model.engine.make_batched_caches(capacity_tokens=1024, page_size=8), prefill_chunk=16)
    ids = [batch.add(p, max_tokens=24, stop_ids=()) for p in prompts]
    got: dict[int, list[int]] = {}
    for sequence_id, token in batch:
        got.setdefault(sequence_id, []).append(token)
    assert min(map(len, prompts[:2])) > 36
    assert [got[i] for i in ids] == alone


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("window", [None, Window(16, keep=4)], ids=["no-window", "window"])
def test_prompts_of_different_lengths_prefill_in_one_forward(model_dir, scheme, window):
    """Short prompts of different lengths share one padded prefill forward (each row its own count;
    under a window of 16 the longer ones wrap their rings in it), and each sequence's tokens are
    those it generates alone: the padding is never written nor attended to."""
    kind, _ = example_kind(scheme, 32)
    model = Model.load(str(model_dir), LoadOptions(kv_cache=kind, kv_eviction=window))
    prompts = [model.encode_prompt(text) for text in PROMPTS]
    assert len({len(p) for p in prompts}) == len(prompts) and max(map(len, prompts)) * len(prompts) <= 192
    alone = [_single(model, p, 10) for p in prompts]
    batch = model.generate_batch(model.engine.make_batched_caches(capacity_tokens=512, page_size=8), prefill_chunk=192)
    ids = [batch.add(p, max_tokens=10, stop_ids=()) for p in prompts]
    assert batch.step() == []  # one forward prefills all four (their first tokens are read a step later)
    assert sorted(i for i, _ in batch.step()) == ids
    got: dict[int, list[int]] = {}
    for sequence_id, token in batch:
        got.setdefault(sequence_id, []).append(token)
    assert [len(got[i]) for i in ids] == [9] * 4  # and the first token each, read above
    assert [alone[k][1:] for k in range(4)] == [got[i] for i in ids]


@pytest.mark.usefixtures("raw_scheme")
def test_a_ragged_step_gives_each_row_its_own_last_logits(model_dir):
    model = example_model(str(model_dir), "raw")
    prompts = [model.encode_prompt(text) for text in PROMPTS[:3]]
    caches = model.engine.make_batched_caches(capacity_tokens=256, page_size=8)
    handles = [caches.open() for _ in prompts]
    for handle, prompt in zip(handles, prompts):
        caches.reserve(handle, len(prompt))
    width = max(map(len, prompts))
    ids = mx.array([p + [0] * (width - len(p)) for p in prompts], dtype=mx.uint32)
    logits = model.engine.run_batched(ids, caches, handles, counts=[len(p) for p in prompts])
    for row, prompt in enumerate(prompts):
        alone = model.engine.forward(prompt, model.engine.make_layer_caches())
        assert (mx.abs(logits[row] - alone).max() / mx.abs(alone).max()).item() < 1e-5
        assert caches.length(handles[row]) == len(prompt)
    with pytest.raises(ConfigError, match=r"counts must give each of the 3 sequences 1\.\.2 positions"):
        model.engine.run_batched(mx.zeros((3, 2), dtype=mx.uint32), caches, handles, counts=[1, 3, 1])


@pytest.mark.usefixtures("raw_scheme")
def test_a_sequence_waits_for_pages_and_a_stop_id_ends_it(model_dir):
    model = example_model(str(model_dir), "raw")
    prompts = [model.encode_prompt(text) for text in PROMPTS[:3]]
    expected = [_single(model, p, 10) for p in prompts]
    two_longest = sorted(len(p) + 10 for p in prompts)[-2:]
    caches = model.engine.make_batched_caches(capacity_tokens=capacity_for(two_longest, 8), page_size=8)  # two at a time
    batch = model.generate_batch(caches)
    ids = [batch.add(p, max_tokens=10, stop_ids=()) for p in prompts]
    stop = expected[2][4]
    last = batch.add(prompts[2], max_tokens=10, stop_ids={stop})
    got: dict[int, list[int]] = {}
    most_running = 0
    while batch.active:
        for sequence_id, token in batch.step():
            got.setdefault(sequence_id, []).append(token)
        most_running = max(most_running, batch.running)
    assert most_running == 2
    assert [got[i] for i in ids] == expected
    assert got[last] == expected[2][: expected[2].index(stop)]
    assert batch.finish_reasons[last] == "stop"


@pytest.mark.usefixtures("raw_scheme")
def test_a_released_handle_is_refused_before_and_after_its_slot_is_reused(model_dir):
    model = example_model(str(model_dir), "raw")
    caches = model.engine.make_batched_caches(capacity_tokens=64, page_size=8)
    first = caches.open()
    caches.reserve(first, 20)
    mx.eval(model.engine.run_batched(mx.array([[1, 2, 3]], dtype=mx.uint32), caches, [first]))
    caches.release(first)
    with pytest.raises(StaleSequenceError, match=r"sequence slot 0 \(generation 0\) was released: its handle is stale"):
        caches.length(first)
    second = caches.open()
    assert second.slot == first.slot and second.generation == 1 and caches.length(second) == 0
    with pytest.raises(StaleSequenceError, match="slot now holds generation 1"):
        model.engine.run_batched(mx.array([[4]], dtype=mx.uint32), caches, [first])
    with pytest.raises(OutOfPagesError, match=r"needs 9 more pages of 8 positions for 72 positions; 8 of 8 are free"):
        caches.reserve(second, 72)
    with pytest.raises(OutOfPagesError, match="reserve them first"):
        model.engine.run_batched(mx.array([[4]], dtype=mx.uint32), caches, [second])


@pytest.mark.usefixtures("raw_scheme")
def test_batched_storage_bytes(model_dir):
    """Pages are allocated whole at creation; live bytes count each open sequence's positions, and
    a sequence holds at most one partly used page."""
    model = example_model(str(model_dir), "raw")
    caches = model.engine.make_batched_caches(capacity_tokens=100, page_size=16)
    assert caches.capacity_tokens == 112 and caches.num_pages == 7
    assert caches.max_sequences == 7 and caches.state_bytes == 0  # attention layers alone: a slot per page
    per_position = 2 * 2 * 32 * 4 * 2  # K and V, 2 KV heads of 32, float32, 2 layers
    assert caches.nbytes_allocated == 112 * per_position
    handle = caches.open()
    caches.reserve(handle, 21)
    assert caches.free_pages == 5
    mx.eval(model.engine.run_batched(mx.arange(21, dtype=mx.uint32)[None], caches, [handle]))
    assert caches.nbytes_live == 21 * per_position


@pytest.mark.usefixtures("raw_scheme")
@settings(max_examples=20, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=4), page_size=st.sampled_from([1, 8, 16]))
def test_capacity_for_holds_exactly_its_sequences(model_dir, lengths, page_size):
    """Caches made with ``capacity_for(lengths)`` give each sequence its positions and leave no page
    free; one more position than that is refused."""
    model = example_model(str(model_dir), "raw")
    caches = model.engine.make_batched_caches(capacity_for(lengths, page_size), page_size=page_size)
    handles = [caches.open() for _ in lengths]
    for handle, n in zip(handles, lengths):
        caches.reserve(handle, n)
    assert caches.free_pages == 0
    with pytest.raises(OutOfPagesError):
        caches.reserve(handles[0], -(-lengths[0] // page_size) * page_size + 1)


def test_sequence_state_bytes_are_counted_per_open_sequence(model_dir):
    """butter-aura's full-precision rows (4 sinks + 32 recent, float16, per sequence slot) count in
    the bytes allocated, and each open sequence's share in the live bytes."""
    if "aura" not in get_plugin_host().schemes:
        pytest.skip("butter-aura is not installed")
    model = example_model(str(model_dir), "aura")
    caches = model.engine.make_batched_caches(capacity_tokens=64, page_size=16, max_sequences=3)
    per_sequence = 2 * 2 * 36 * 2 * 32 * 2  # K and V, 2 layers, 36 rows of 2 KV heads of 32, float16
    pages = caches.nbytes_allocated - 3 * per_sequence
    assert pages == sum(p.bytes_per_slot for p in caches.prototypes) * 64
    handle = caches.open()
    caches.reserve(handle, 10)
    mx.eval(model.engine.run_batched(mx.arange(10, dtype=mx.uint32)[None], caches, [handle]))
    assert caches.nbytes_live == 10 * pages // 64 + per_sequence


@pytest.mark.usefixtures("raw_scheme")
def test_what_batched_caches_do_not_take_yet_is_refused_clearly(model_dir):
    model = example_model(str(model_dir), "raw")
    batch = model.generate_batch(model.engine.make_batched_caches(capacity_tokens=64, page_size=8))
    with pytest.raises(ConfigError, match=r"need 9 pages; the batched caches hold 8 \(capacity_tokens 64\)"):
        batch.add([1, 2, 3], max_tokens=66)
    batch = model.generate_batch(model.engine.make_batched_caches(capacity_tokens=4096, page_size=8))
    with pytest.raises(ContextLengthError, match=r"max_tokens 600 need 603 positions, but the KV cache holds 512 "
                                                 r"\(the model's max_position_embeddings, 512\)"):  # as generate refuses
        batch.add([1, 2, 3], max_tokens=600)
    with pytest.raises(ConfigError, match="capacity_tokens must be a positive integer"):
        model.engine.make_batched_caches(capacity_tokens=0)


class BatchMachine(RuleBasedStateMachine):
    """Random joins, steps and cancellations against the single-sequence engine: every sequence's
    tokens are a prefix of (cancelled) or equal to (ended) what it generates alone."""

    model: Model

    def __init__(self):
        super().__init__()
        self.caches = self.model.engine.make_batched_caches(capacity_tokens=96, page_size=8)
        self.batch = self.model.generate_batch(self.caches, prefill_chunk=5)
        self.requests: dict[int, tuple[int, int]] = {}
        self.got: dict[int, list[int]] = {}

    @rule(prompt=st.integers(0, len(PROMPTS) - 1), max_tokens=st.integers(1, 12))
    def add(self, prompt, max_tokens):
        sequence_id = self.batch.add(_encoded(self.model, prompt), max_tokens=max_tokens, stop_ids=())
        self.requests[sequence_id] = (prompt, max_tokens)
        self.got[sequence_id] = []

    @precondition(lambda self: self.batch.active)
    @rule()
    def step(self):
        for sequence_id, token in self.batch.step():
            self.got[sequence_id].append(token)

    @precondition(lambda self: self.batch.active)
    @rule(data=st.data())
    def cancel(self, data):
        live = sorted(set(self.requests) - set(self.batch.finish_reasons))
        self.batch.cancel(data.draw(st.sampled_from(live)))

    @invariant()
    def tokens_are_the_single_sequence_tokens(self):
        for sequence_id, (prompt, max_tokens) in self.requests.items():
            alone = _alone(self.model, prompt, max_tokens)
            got = self.got[sequence_id]
            if self.batch.finish_reasons.get(sequence_id) == "length":
                assert got == alone
            else:
                assert got == alone[: len(got)]
        if not self.batch.active:
            assert self.caches.free_pages == self.caches.num_pages


@functools.cache
def _encoded(model: Model, prompt: int) -> tuple[int, ...]:
    return tuple(model.encode_prompt(PROMPTS[prompt]))


@functools.cache
def _alone(model: Model, prompt: int, max_tokens: int) -> list[int]:
    return _single(model, list(_encoded(model, prompt)), max_tokens)


@pytest.mark.usefixtures("raw_scheme")
def test_random_joins_steps_and_cancellations(model_dir):
    BatchMachine.model = example_model(str(model_dir), "raw")
    BatchMachine.TestCase.settings = settings(max_examples=15, stateful_step_count=25, deadline=None)
    BatchMachine.TestCase().runTest()


@pytest.mark.usefixtures("raw_scheme")
def test_a_reservation_is_taken_as_the_sequence_grows_and_promised_pages_are_not_admitted(model_dir):
    """A sequence is admitted with the pages its prompt plus max_tokens need and takes them step by
    step; pages promised to it are not free for admission, so a second sequence whose liability
    needs them waits, though the pages are free, until the first ends."""
    model = example_model(str(model_dir), "raw")
    caches = model.engine.make_batched_caches(capacity_tokens=64, page_size=8)  # 8 pages
    batch = model.generate_batch(caches)
    first = batch.add([5, 6, 7, 8, 9], max_tokens=30, stop_ids=())  # 35 positions: 5 pages
    second = batch.add([5, 6, 7, 8, 9], max_tokens=20, stop_ids=())  # 25 positions: 4 pages
    held = []
    while first not in batch.finish_reasons:
        batch.step()
        if first in batch.finish_reasons:
            break
        assert batch.running == 1 and batch.active == 2
        held.append(caches.num_pages - caches.free_pages)
        assert held[-1] + batch.promised_pages == 5
    assert held[0] == 1 and held[-1] == 5 and held == sorted(held)
    batch.step()
    assert batch.running == 1 and second not in batch.finish_reasons
    list(batch)
    assert caches.free_pages == caches.num_pages and batch.promised_pages == 0


@pytest.mark.usefixtures("raw_scheme")
def test_decoding_counts_the_sequences_past_their_prompts(model_dir):
    """The next step's decode batch: a sequence joins it once its prompt is read whole, and leaves
    it once its last token is sampled."""
    model = example_model(str(model_dir), "raw")
    batch = BatchGeneration(model.engine, model.engine.make_batched_caches(capacity_tokens=128, page_size=8),
                            prefill_chunk=4)  # fmt: skip
    batch.add([5, 6, 7], max_tokens=6, stop_ids=())  # its prompt in one chunk
    batch.add(list(range(5, 15)), max_tokens=2, stop_ids=())  # in three
    assert batch.decoding == 0
    seen = []
    while batch.active:
        batch.step()
        seen.append(batch.decoding)
    assert seen[:5] == [1, 1, 1, 2, 1] and seen[-1] == 0
