"""Each of the scheme's GPU kernels against its pure-MLX reference, on the machine's backend."""

from __future__ import annotations

import pytest

from butter_core.kernels import gpu_backend
from butter_core.plugins import get_plugin_host
from butter_core.testing.fixtures import SchemeFixtures


class KernelTests(SchemeFixtures):
    """Runs every case of every ``KernelCheck`` the scheme lists; skipped where no GPU backend exists."""

    def test_kernels_match_references(self):
        checks = list(get_plugin_host().schemes[self.scheme].scheme.kernel_checks())
        if not checks:
            pytest.skip(f"{self.scheme} lists no kernels")
        if gpu_backend() is None:
            pytest.skip(f"no GPU backend in this MLX: kernels {[c.name for c in checks]} not run here")
        results = [check.check(seed, **case) for check in checks for case in check.cases for seed in range(2)]
        failed = [result for result in results if not result.passed]
        assert not failed, failed
