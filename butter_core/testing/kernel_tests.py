"""Each of the scheme's GPU kernels against its pure-MLX reference, on the machine's backend,
and its Metal sources through clang's front end, on any machine."""

from __future__ import annotations

import pytest

from butter_core.kernels import gpu_backend
from butter_core.kernels.metal_check import metal_builds, metal_errors
from butter_core.plugins import get_plugin_host
from butter_core.testing.fixtures import SchemeFixtures


class KernelTests(SchemeFixtures):
    """Runs every case of every ``KernelCheck`` the scheme lists, where a GPU backend exists,
    and checks every Metal build they make with ``butter_core.kernels.metal_check``, where
    libclang is installed."""

    def _checks(self) -> list:
        checks = list(get_plugin_host().schemes[self.scheme].scheme.kernel_checks())
        if not checks:
            pytest.skip(f"{self.scheme} lists no kernels")
        return checks

    def test_kernels_match_references(self):
        backend = gpu_backend()
        if backend is None:
            pytest.skip(f"no GPU backend in this MLX: kernels {[c.name for c in self._checks()]} not run here")
        checks = [check for check in self._checks() if check.runs_on(backend)]
        results = [check.check(seed, **case) for check in checks for case in check.cases for seed in range(2)]
        failed = [result for result in results if not result.passed]
        assert not failed, failed

    def test_metal_sources_pass_the_front_end(self):
        pytest.importorskip("clang.cindex", reason="the Metal front-end check needs libclang (pip install libclang)")
        builds = metal_builds(self._checks())
        errors = [error for build in builds for error in metal_errors(build)]
        assert not errors, "\n".join(errors)
