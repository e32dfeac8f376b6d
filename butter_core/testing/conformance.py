"""The umbrella class: subclass it once and every part of the suite runs."""

from butter_core.testing.cache_tests import (
    AccountingTests,
    AppendAttendTests,
    DiscoveryTests,
    ParameterTests,
    StateTests,
    WindowTests,
)
from butter_core.testing.kernel_tests import KernelTests
from butter_core.testing.state_machine import StateMachineTests


class SchemeConformance(
    DiscoveryTests,
    AppendAttendTests,
    WindowTests,
    StateTests,
    AccountingTests,
    ParameterTests,
    KernelTests,
    StateMachineTests,
):
    """Every conformance check for one scheme. Set ``scheme`` and provide the fixtures of ``SchemeFixtures``."""
