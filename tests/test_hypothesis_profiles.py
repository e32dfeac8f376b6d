"""The conformance suite's hypothesis profiles: butter-ci by default, butter-deep on request,
through the environment or pytest's own ``--hypothesis-profile`` (butter-core's pytest plugin
registers them before hypothesis reads the option). Each case is a real pytest run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from butter_core.errors import ConfigError
from butter_core.testing.profiles import PROFILE_ENV, PROFILES, suite_settings

PROBE = """
from butter_core.testing.profiles import suite_settings

def test_profile():
    chosen = suite_settings()
    print(f"@@{chosen.max_examples} {chosen.stateful_step_count}")
"""

pytestmark = pytest.mark.plugin_independent



def chosen_profile(tmp_path, *options, env=None) -> tuple[int, int]:
    (tmp_path / "test_probe.py").write_text(PROBE)
    environment = {k: v for k, v in os.environ.items() if k != PROFILE_ENV} | (env or {})
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", *options,
                           str(tmp_path / "test_probe.py")], capture_output=True, text=True, env=environment)  # fmt: skip
    line = next((line for line in done.stdout.splitlines() if "@@" in line), None)
    assert line, done.stdout + done.stderr
    examples, steps = line.split("@@")[1].split()
    return int(examples), int(steps)


def as_tuple(name: str) -> tuple[int, int]:
    return PROFILES[name]["max_examples"], PROFILES[name]["stateful_step_count"]


def test_ci_is_the_default(tmp_path):
    assert chosen_profile(tmp_path) == as_tuple("ci")


def test_deep_through_the_environment(tmp_path):
    assert chosen_profile(tmp_path, env={PROFILE_ENV: "deep"}) == as_tuple("deep") == (2000, 100)


def test_deep_through_hypothesis_own_option(tmp_path):
    assert chosen_profile(tmp_path, "--hypothesis-profile", "butter-deep") == as_tuple("deep")


def test_an_unknown_profile_is_named(monkeypatch):
    monkeypatch.setenv(PROFILE_ENV, "deeper")
    with pytest.raises(ConfigError, match="BUTTER_HYPOTHESIS_PROFILE=.deeper.: valid profiles are quick, ci, deep"):
        suite_settings()
