"""The conformance suites every cache scheme runs: ours and third parties'.

Attention schemes subclass :class:`SchemeConformance`; recurrent-layer schemes (Mamba2,
gated delta) subclass :class:`RecurrentConformance` (``recurrent_tests``), the same way.

A scheme's distribution subclasses :class:`SchemeConformance` in its own
``tests/test_conformance.py``, sets ``scheme`` to its registered name and provides
the fixtures of :class:`SchemeFixtures` (each raises ``NotImplementedError`` with
the contract until provided)::

    from butter_core.testing import SchemeConformance

    class TestRaw(SchemeConformance):
        scheme = "raw"

        @pytest.fixture(params=["raw", "raw-float32"])
        def cache_kind(self, request):
            return parse_kv_cache(request.param)
        ...
"""

from butter_core.testing.conformance import SchemeConformance
from butter_core.testing.fixtures import Capabilities, SchemeFixtures, on_the_cpu
from butter_core.testing.recurrent_tests import RecurrentConformance, RecurrentFixtures

__all__ = ["Capabilities", "RecurrentConformance", "RecurrentFixtures", "SchemeConformance", "SchemeFixtures", "on_the_cpu"]
