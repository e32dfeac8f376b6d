"""Meta-test: every installed scheme is checked by a SchemeConformance (or, for a recurrent-layer
scheme, RecurrentConformance) subclass in this run."""

import pytest

from butter_core.plugins import PluginHost
from butter_core.testing import RecurrentConformance, SchemeConformance


def test_every_installed_scheme_has_a_conformance_subclass(request):
    covered = {
        item.cls.scheme
        for item in request.session.items
        if item.cls is not None and issubclass(item.cls, SchemeConformance | RecurrentConformance)
    }
    host = PluginHost()
    missing = {
        name: registered.plugin.distribution for name, registered in host.schemes.items() if name not in covered
    }
    assert not missing, (
        f"installed schemes without a SchemeConformance subclass among the collected tests: {missing}. "
        "Each scheme's distribution needs tests/test_conformance.py subclassing butter_core.testing.SchemeConformance "
            "(RecurrentConformance for a recurrent-layer scheme), "
        "and this run must collect it (tox's env for that distribution does)."
    )


def test_core_alone_names_the_distribution_to_install():
    """In the ``core`` tox env no scheme is installed: asking for one says what to pip install."""
    host = PluginHost()
    if host.schemes:
        pytest.skip("schemes are installed; tests/test_plugin_loading.py covers the empty case via BUTTER_LOAD_PLUGINS")
    from butter_core import UnknownSchemeError

    try:
        host.parse_kv_cache("raw")
    except UnknownSchemeError as exc:
        assert "installed schemes: none" in str(exc) and "pip install butter-raw" in str(exc)
    else:
        raise AssertionError("parse_kv_cache('raw') must fail when no scheme is installed")
