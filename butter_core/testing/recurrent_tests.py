"""The conformance suite of recurrent-layer schemes (Mamba2 and gated delta state caches).

A scheme's distribution subclasses :class:`RecurrentConformance` in its own tests, sets
``scheme`` and provides ``cache_kind``, ``state_tolerance`` and ``invalid_kinds``; the suite
runs every layer type the scheme registers. The reference is the mixer's own computation
(``butter_core.recurrent``) over the whole input history from the zero state, in float32:
whatever a scheme keeps between calls, and however the tokens were chunked, its outputs
must stay within ``state_tolerance`` of it.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from butter_core.config import CacheKind
from butter_core.errors import ConfigError
from butter_core.layer_caches import make_layer_caches
from butter_core.plugins import get_plugin_host
from butter_core.recurrent import GATED_DELTA, MAMBA2, GatedDeltaMixer, Mamba2Mixer, StateSpec
from butter_core.testing.cache_tests import DiscoveryTests, ParameterTests
from butter_core.testing.fixtures import SchemeFixtures
from butter_core.testing.kernel_tests import KernelTests
from butter_core.testing.profiles import suite_settings
from butter_core.testing.reference import relative_error

CONV_KERNEL = 4
MIXER_CHUNK = 8
"""The mixers' prefill chunk in the suite: small, so a 40-token sequence spans several chunks."""

CHUNK_PATTERNS = {
    "one-at-a-time": [1] * 12,
    "prefill-then-decode": [19, 1, 1, 1],
    "mixed": [5, 1, 7, 1, 20, 3],
    "chunk-boundaries": [8, 8, 16, 1, 9],
}


def state_spec(layer_type: str, dtype: mx.Dtype, batch_size: int = 1) -> StateSpec:
    """The suite's small layer of ``layer_type``: Mamba2 of 4 heads of 8, 2 groups of state 8;
    gated delta of 2 key heads and 4 value heads, Dk 16, Dv 8."""
    if layer_type == MAMBA2:
        return StateSpec(MAMBA2, conv_dim=4 * 8 + 2 * 2 * 8, conv_kernel=CONV_KERNEL, state_shape=(4, 8, 8),
                         dtype=dtype, batch_size=batch_size)  # fmt: skip
    if layer_type == GATED_DELTA:
        return StateSpec(GATED_DELTA, conv_dim=2 * 2 * 16 + 4 * 8, conv_kernel=CONV_KERNEL, state_shape=(4, 16, 8),
                         dtype=dtype, batch_size=batch_size)  # fmt: skip
    raise ValueError(f"the suite has no layer of type {layer_type!r}")


def random_mixer(spec: StateSpec, seed: int = 0) -> Mamba2Mixer | GatedDeltaMixer:
    """A mixer for ``spec`` with random weights of a real layer's scale, in the spec's dtype."""
    keys = mx.random.split(mx.random.key(seed), 5)
    heads = spec.state_shape[0]
    conv_weight = (mx.random.normal((spec.conv_dim, spec.conv_kernel), key=keys[0]) * 0.5).astype(spec.dtype)
    conv_bias = (mx.random.normal((spec.conv_dim,), key=keys[1]) * 0.1).astype(spec.dtype)
    dt_bias = mx.random.uniform(-2.0, 0.5, (heads,), key=keys[2])
    a_log = mx.random.uniform(-1.0, 1.5, (heads,), key=keys[3])
    if spec.layer_type == MAMBA2:
        _, head_dim, state_size = spec.state_shape
        groups = (spec.conv_dim - heads * head_dim) // (2 * state_size)
        return Mamba2Mixer(conv_weight, conv_bias, dt_bias, -mx.exp(a_log), mx.random.normal((heads,), key=keys[4]),
                           heads=heads, head_dim=head_dim, groups=groups, state_size=state_size,
                           chunk_size=MIXER_CHUNK)  # fmt: skip
    _, key_dim, value_dim = spec.state_shape
    key_heads = (spec.conv_dim - heads * value_dim) // (2 * key_dim)
    return GatedDeltaMixer(conv_weight, None, a_log, dt_bias, key_heads=key_heads, value_heads=heads, key_dim=key_dim,
                           value_dim=value_dim, chunk_size=MIXER_CHUNK)  # fmt: skip


def random_inputs(spec: StateSpec, tokens: int, key: mx.array) -> tuple[mx.array, ...]:
    """The inputs of ``update_and_mix`` for ``tokens`` positions of a layer of ``spec``."""
    first, second, third = mx.random.split(key, 3)
    batch, heads = spec.batch_size, spec.state_shape[0]
    conv_in = mx.random.normal((batch, tokens, spec.conv_dim), key=first).astype(spec.dtype)
    gates = [mx.random.normal((batch, tokens, heads), key=k).astype(spec.dtype) for k in (second, third)]
    return (conv_in, gates[0]) if spec.layer_type == MAMBA2 else (conv_in, *gates)


class ReferenceState:
    """The yardstick: keeps every input and recomputes the whole history from the zero state."""

    def __init__(self, mixer):
        self.mixer = mixer
        self.history: list[tuple[mx.array, ...]] = []

    @property
    def position(self) -> int:
        return sum(inputs[0].shape[1] for inputs in self.history)

    def update_and_mix(self, *inputs: mx.array) -> mx.array:
        self.history.append(inputs)
        whole = [mx.concatenate([step[i] for step in self.history], axis=1).astype(mx.float32) for i in range(len(inputs))]
        out, _, _ = self.mixer.reference(None, None, *whole)
        return out[:, -inputs[0].shape[1] :]

    def rewind(self, position: int) -> None:
        kept, held = [], 0
        for inputs in self.history:
            if held >= position:
                break
            kept.append(inputs)
            held += inputs[0].shape[1]
        assert held == position, "snapshots are taken between updates"
        self.history = kept


def make_state_cache(kind: CacheKind, spec: StateSpec):
    return make_layer_caches(kind, [spec])[0]


class RecurrentFixtures(SchemeFixtures):
    """The fixtures a recurrent conformance subclass provides (``cache_kind``, ``invalid_kinds``
    and ``capabilities``, whose ``dtypes`` alone apply, as for attention schemes; and
    ``state_tolerance``), and those the suite provides."""

    @pytest.fixture
    def state_tolerance(self, cache_kind, dtype) -> float:
        """Largest allowed ‖out − ref‖ / ‖ref‖ of a mixer's output against the float32 reference
        over the whole input history, for ``cache_kind`` in model dtype ``dtype``."""
        raise NotImplementedError("provide state_tolerance(cache_kind, dtype) -> relative error bound")

    @pytest.fixture(params=[MAMBA2, GATED_DELTA])
    def layer_type(self, request) -> str:
        """Each layer type the suite knows, skipped where the scheme does not store it."""
        if request.param not in get_plugin_host().schemes[self.scheme].scheme.layer_types:
            pytest.skip(f"{self.scheme} does not store {request.param} layers")
        return request.param

    @pytest.fixture
    def spec(self, layer_type, dtype) -> StateSpec:
        return state_spec(layer_type, dtype)

    @pytest.fixture
    def mixer(self, spec):
        return random_mixer(spec)


def run_pattern(cache, reference: ReferenceState, spec: StateSpec, pattern, seed: int = 0):
    """Feed chunks of ``pattern`` tokens to both; yield (output, reference output) per chunk."""
    for i, tokens in enumerate(pattern):
        inputs = random_inputs(spec, tokens, mx.random.key(seed * 1000 + i))
        yield cache.update_and_mix(reference.mixer, *inputs), reference.update_and_mix(*inputs)


class UpdateTests(RecurrentFixtures):
    """Updates by chunks of any length (prefill) and by one token (decode) match the reference."""

    @pytest.mark.parametrize("pattern", CHUNK_PATTERNS.values(), ids=CHUNK_PATTERNS.keys())
    def test_outputs_match_the_reference(self, cache_kind, spec, mixer, state_tolerance, pattern):
        cache, reference = make_state_cache(cache_kind, spec), ReferenceState(mixer)
        for out, ref in run_pattern(cache, reference, spec, pattern):
            assert out.shape == ref.shape and out.dtype == spec.dtype
            assert relative_error(out, ref) <= state_tolerance
        assert cache.absolute_position == sum(pattern)

    def test_the_chunking_does_not_change_what_follows(self, cache_kind, spec, mixer, state_tolerance):
        inputs = random_inputs(spec, 30, mx.random.key(7))
        outs = []
        for pattern in ([30], [1] * 30, [13, 1, 16]):
            cache, start = make_state_cache(cache_kind, spec), 0
            for tokens in pattern:
                cache.update_and_mix(mixer, *(x[:, start : start + tokens] for x in inputs))
                start += tokens
            outs.append(cache.update_and_mix(mixer, *random_inputs(spec, 3, mx.random.key(8))))
        for out in outs[1:]:
            assert relative_error(out, outs[0]) <= state_tolerance

    def test_batched_sequences_are_independent(self, cache_kind, layer_type, dtype, mixer, state_tolerance):
        spec = state_spec(layer_type, dtype, batch_size=2)
        cache = make_state_cache(cache_kind, spec)
        inputs = random_inputs(spec, 9, mx.random.key(3))
        out = cache.update_and_mix(mixer, *inputs)
        for row in range(2):
            single = make_state_cache(cache_kind, state_spec(layer_type, dtype))
            alone = single.update_and_mix(mixer, *(x[row : row + 1] for x in inputs))
            assert relative_error(out[row : row + 1], alone) <= state_tolerance

    def test_inputs_of_the_wrong_shape_are_a_config_error(self, cache_kind, spec, mixer):
        cache = make_state_cache(cache_kind, spec)
        conv_in, *gates = random_inputs(spec, 2, mx.random.key(0))
        with pytest.raises(ConfigError, match="mixer input of shape"):
            cache.update_and_mix(mixer, conv_in[..., :-1], *gates)
        assert cache.absolute_position == 0


class SnapshotTests(RecurrentFixtures):
    """The state cannot be trimmed; a snapshot, an export and an import bring it back exactly."""

    def test_rewind_to_a_snapshot_repeats_outputs_exactly(self, cache_kind, spec, mixer):
        cache = make_state_cache(cache_kind, spec)
        cache.update_and_mix(mixer, *random_inputs(spec, 11, mx.random.key(1)))
        snapshot = cache.snapshot()
        more = random_inputs(spec, 5, mx.random.key(2))
        first = cache.update_and_mix(mixer, *more)
        cache.update_and_mix(mixer, *random_inputs(spec, 1, mx.random.key(3)))
        cache.rewind(snapshot)
        assert cache.absolute_position == snapshot.position == 11
        assert mx.array_equal(cache.update_and_mix(mixer, *more), first)

    def test_state_round_trip_continues_exactly(self, cache_kind, spec, mixer):
        cache = make_state_cache(cache_kind, spec)
        cache.update_and_mix(mixer, *random_inputs(spec, 9, mx.random.key(4)))
        restored = make_state_cache(cache_kind, spec)
        restored.restore(cache.state(), cache.meta_state())
        more = random_inputs(spec, 3, mx.random.key(5))
        assert restored.absolute_position == 9
        assert mx.array_equal(restored.update_and_mix(mixer, *more), cache.update_and_mix(mixer, *more))

    def test_trim_drops_nothing(self, cache_kind, spec, mixer):
        cache = make_state_cache(cache_kind, spec)
        cache.update_and_mix(mixer, *random_inputs(spec, 4, mx.random.key(6)))
        assert cache.trim(2) == 0 and cache.absolute_position == 4

    def test_a_foreign_state_is_refused(self, cache_kind, spec):
        cache = make_state_cache(cache_kind, spec)
        with pytest.raises(ConfigError):
            cache.restore({"conv": mx.zeros((1, 1, 1))}, {"position": 0})


class StateAccountingTests(RecurrentFixtures):
    """Bytes are constant in the context length and equal what ``state()`` holds."""

    def test_bytes_do_not_grow_with_the_context(self, cache_kind, spec, mixer):
        cache = make_state_cache(cache_kind, spec)
        before = cache.nbytes_allocated
        for tokens in (1, 40, 1):
            cache.update_and_mix(mixer, *random_inputs(spec, tokens, mx.random.key(tokens)))
            assert cache.nbytes_allocated == before
        assert cache.nbytes_live == sum(a.nbytes for a in cache.state().values()) > 0
        assert cache.capacity is None


def state_machine(kind, spec, mixer, tolerance):
    """A state machine of random updates, snapshots, rewinds and round trips against the reference."""

    class RecurrentMachine(RuleBasedStateMachine):
        @initialize()
        def create(self):
            self.cache = make_state_cache(kind, spec)
            self.reference = ReferenceState(mixer)
            self.snapshots = []
            self.seed = 0

        @precondition(lambda self: self.reference.position < 120)
        @rule(tokens=st.sampled_from([1, 1, 1, 2, 5, 8, 13]))
        def update(self, tokens):
            self.seed += 1
            inputs = random_inputs(spec, tokens, mx.random.key(self.seed))
            out = self.cache.update_and_mix(mixer, *inputs)
            assert relative_error(out, self.reference.update_and_mix(*inputs)) <= tolerance

        @rule()
        def snapshot(self):
            self.snapshots.append(self.cache.snapshot())

        @precondition(lambda self: self.snapshots)
        @rule(data=st.data())
        def rewind(self, data):
            snapshot = data.draw(st.sampled_from(self.snapshots))
            self.cache.rewind(snapshot)
            self.reference.rewind(snapshot.position)
            self.snapshots = [s for s in self.snapshots if s.position <= snapshot.position]

        @rule()
        def round_trip(self):
            restored = make_state_cache(kind, spec)
            restored.restore(self.cache.state(), self.cache.meta_state())
            self.cache = restored

        @invariant()
        def positions_agree(self):
            if hasattr(self, "cache"):
                assert self.cache.absolute_position == self.reference.position

    return RecurrentMachine


class RecurrentStateMachineTests(RecurrentFixtures):
    def test_random_operation_sequences(self, cache_kind, spec, mixer, state_tolerance):
        run_state_machine_as_test(state_machine(cache_kind, spec, mixer, state_tolerance), settings=suite_settings())


class RecurrentConformance(
    DiscoveryTests,
    UpdateTests,
    SnapshotTests,
    StateAccountingTests,
    ParameterTests,
    KernelTests,
    RecurrentStateMachineTests,
):
    """Every conformance check for one recurrent scheme. Set ``scheme`` and provide the fixtures
    ``cache_kind``, ``state_tolerance`` and ``invalid_kinds`` (``RecurrentFixtures``)."""
