"""The conformance suite every cache scheme runs: ours and third parties'.

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

__all__ = ["Capabilities", "SchemeConformance", "SchemeFixtures", "on_the_cpu"]
