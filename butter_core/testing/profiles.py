"""Hypothesis profiles for the conformance suite's property tests: ``butter-ci`` (the default),
``butter-deep`` and ``butter-quick``.

Choose one with ``BUTTER_HYPOTHESIS_PROFILE=quick|ci|deep`` or pytest's ``--hypothesis-profile
butter-deep`` (this module is a pytest plugin, registered through butter-core's ``pytest11``
entry point, so the names exist before hypothesis reads the option). ``suite_settings()``
is what the suite runs under: the variable, else a ``butter-*`` profile pytest loaded, else
``butter-ci``. ``butter-ci`` is sized so that every window of the state machine wraps many
times for every scheme within CI's time (14 to 136 wraps per window and scheme, 0.5-1.3 s a
run on a 2-core CPU; docs/benchmarks.md); ``butter-deep`` is for a scheme author's longer
run (2,000 sequences of up to 100 steps per window); ``butter-quick`` for a run that repeats
others (tox's ``all`` env, whose schemes' own envs ran ``butter-ci``).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

from butter_core.errors import ConfigError

PROFILE_ENV = "BUTTER_HYPOTHESIS_PROFILE"
PROFILES = {
    "quick": {"max_examples": 2, "stateful_step_count": 40},
    "ci": {"max_examples": 10, "stateful_step_count": 40},
    "deep": {"max_examples": 2000, "stateful_step_count": 100},
}
"""Short name -> what it sets; registered as ``butter-<name>``."""

for _name, _values in PROFILES.items():
    settings.register_profile(f"butter-{_name}", deadline=None, suppress_health_check=list(HealthCheck), **_values)


def suite_settings() -> settings:
    """The profile the suite's property tests run under (see the module docstring)."""
    chosen = os.environ.get(PROFILE_ENV)
    if chosen is not None:
        if chosen not in PROFILES:
            raise ConfigError(f"{PROFILE_ENV}={chosen!r}: valid profiles are {', '.join(PROFILES)}")
        return settings.get_profile(f"butter-{chosen}")
    loaded = settings.get_current_profile_name()
    return settings.get_profile(loaded if loaded.startswith("butter-") else "butter-ci")
