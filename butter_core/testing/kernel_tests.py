"""Each of the scheme's GPU kernels against its pure-MLX reference, on the machine's backend."""

from __future__ import annotations

import mlx.core as mx
import pytest

from butter_core.plugins import get_plugin_host
from butter_core.testing.fixtures import SchemeFixtures


class KernelTests(SchemeFixtures):
    """Runs every ``KernelCheck`` the scheme lists; skipped where no GPU backend exists."""

    def test_kernels_match_references(self):
        checks = list(get_plugin_host().schemes[self.scheme].scheme.kernel_checks())
        if not checks:
            pytest.skip(f"{self.scheme} lists no kernels")
        runnable = [check for check in checks if check.available()]
        if not runnable:
            pytest.skip(f"no GPU backend on {mx.default_device()}: kernels {[c.name for c in checks]} not run here")
        for check in runnable:
            for seed in range(3):
                check.verify(seed)
