"""Hypothesis drives random appends, trims and state round trips against the reference model,
as deep as the chosen profile says (``butter_core.testing.profiles``)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from butter_core.config import Window
from butter_core.testing.cache_tests import GQA, make_cache
from butter_core.testing.fixtures import SchemeFixtures
from butter_core.testing.profiles import suite_settings
from butter_core.testing.reference import ReferenceCache, random_chunk, relative_error

WINDOWS = {
    "no-window": None,
    "16-keep-2": Window(max_size=16, keep=2),
    "9-keep-0": Window(max_size=9, keep=0),
    "48-keep-4": Window(max_size=48, keep=4),
}
"""Each window gets its own run of the machine, so each wraps many times (rings of 14, 9 and
44 slots; 44 is not a multiple of AURA's 32 recent rows)."""


def cache_machine(kind, spec, tolerance, capabilities, window: Window | None = None):
    """A state machine class checking one scheme configuration under ``window`` (or none)."""

    class CacheMachine(RuleBasedStateMachine):
        @initialize()
        def create(self):
            self.window = window
            self.cache = make_cache(kind, spec, window)
            self.reference = ReferenceCache(window)
            self.seed = 0

        @precondition(lambda self: self.window is not None or self.reference.position < spec.max_positions - 24)
        @rule(tokens=st.integers(1, 20))
        def append(self, tokens):
            self.seed += 1
            q, k, v = random_chunk(spec, tokens, spec.n_kv_heads * GQA, mx.random.key(self.seed))
            scale = spec.head_dim**-0.5
            out = self.cache.update_and_attend(q, k, v, scale=scale)
            ref = self.reference.update_and_attend(q, k, v, scale=scale)
            assert relative_error(out, ref) <= tolerance

        @precondition(lambda self: capabilities.trim)
        @rule(n=st.integers(0, 12))
        def trim(self, n):
            assert self.cache.trim(n) == self.reference.trim(n)

        @precondition(lambda self: capabilities.state)
        @rule()
        def round_trip(self):
            restored = make_cache(kind, spec, self.window)
            restored.restore(self.cache.state(), self.cache.meta_state())
            self.cache = restored

        @invariant()
        def positions_agree(self):
            if hasattr(self, "cache"):
                assert self.cache.absolute_position == self.reference.position
                assert self.cache.length == self.reference.live

    return CacheMachine


class StateMachineTests(SchemeFixtures):
    """Random sequences of appends, evictions, trims and round trips agree with the reference."""

    @pytest.mark.parametrize("window", WINDOWS.values(), ids=WINDOWS.keys())
    def test_random_operation_sequences(self, cache_kind, layer_spec, attention_tolerance, capabilities, window):
        if window is not None and not capabilities.window:
            pytest.skip(f"{self.scheme} does not claim window eviction")
        machine = cache_machine(cache_kind, layer_spec, attention_tolerance, capabilities, window)
        run_state_machine_as_test(machine, settings=suite_settings())
