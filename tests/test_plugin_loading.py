"""Plugin loading: real entry points in real (temporary) distributions, each failure contained and named."""

from __future__ import annotations

import importlib
import sys
import textwrap

import pytest

from butter_core import Raw, UnknownSchemeError, make_layer_caches
from butter_core.cache import LayerSpec
from butter_core.plugins import PluginHost

GOOD = """
from butter_core import CacheScheme, CacheKind, hookimpl
import attrs

@attrs.frozen
class {cls}(CacheKind):
    scheme = "{scheme}"
    def __str__(self):
        return "{scheme}"

@hookimpl
def butter_register_cache_schemes(register):
    register(CacheScheme(name="{scheme}", kind_type={cls}, parse=lambda t: {cls}() if t == "{scheme}" else None,
                         create=lambda kind, specs: [], examples=("{scheme}",)))
"""


@pytest.fixture
def install(tmp_path, monkeypatch):
    """Install a throwaway distribution with one ``butter.caches`` entry point."""
    monkeypatch.syspath_prepend(str(tmp_path))
    added = []

    def install(dist: str, module: str, source: str, entry_name: str | None = None):
        (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
        info = tmp_path / f"{dist.replace('-', '_')}-1.2.3.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.2.3\n")
        (info / "entry_points.txt").write_text(f"[butter.caches]\n{entry_name or module} = {module}\n")
        added.append(module)
        importlib.invalidate_caches()

    yield install
    for module in added:
        sys.modules.pop(module, None)


@pytest.fixture
def only(monkeypatch):
    def restrict(*names):
        monkeypatch.setenv("BUTTER_LOAD_PLUGINS", ",".join(names))
        return PluginHost()

    return restrict


def test_good_plugin_loads_with_distribution_and_version(install, only):
    install("butter-good", "good_plugin", GOOD.format(cls="GoodKind", scheme="good"))
    host = only("butter-good")
    assert host.problems == []
    record = host.plugins["good_plugin"]
    assert (record.distribution, record.version, record.schemes) == ("butter-good", "1.2.3", ["good"])
    assert record.hooks == ["butter_register_cache_schemes"]
    assert str(host.parse_kv_cache("good")) == "good"


def test_import_failure_is_named_and_others_keep_working(install, only):
    install("butter-good", "good_plugin", GOOD.format(cls="GoodKind", scheme="good"))
    install("butter-broken", "broken_plugin", "import no_such_module_anywhere\n")
    host = only("butter-good", "butter-broken")
    assert "good" in host.schemes
    (problem,) = host.problems
    assert problem.distribution == "butter-broken"
    assert "failed to import broken_plugin" in problem.message and "no_such_module_anywhere" in problem.message


def test_missing_required_hook(install, only):
    install("butter-empty", "empty_plugin", "from butter_core import hookimpl\n")
    host = only("butter-empty")
    assert "empty_plugin" not in host.plugins
    assert "implements none of the registration hooks butter_register_cache_schemes" in host.problems[0].message


def test_hook_arguments_must_match_the_spec(install, only):
    install(
        "butter-badargs",
        "badargs_plugin",
        "from butter_core import hookimpl\n@hookimpl\ndef butter_register_cache_schemes(register, extra):\n    pass\n",
    )
    host = only("butter-badargs")
    assert host.problems[0].distribution == "butter-badargs"
    assert "extra" in host.problems[0].message


def test_unknown_hook_name_is_reported(install, only):
    source = GOOD.format(cls="TypoKind", scheme="typo") + "\n@hookimpl\ndef butter_register_cache_shemes(register):\n    pass\n"
    install("butter-typo", "typo_plugin", source)
    host = only("butter-typo")
    assert "unknown hook butter_register_cache_shemes" in host.problems[0].message
    assert "typo" not in host.schemes


def test_scheme_name_owned_by_another_distribution(install, only):
    install("butter-first", "first_plugin", GOOD.format(cls="FirstKind", scheme="dup"))
    install("butter-second", "second_plugin", GOOD.format(cls="SecondKind", scheme="dup"))
    host = only("butter-first", "butter-second")
    assert host.schemes["dup"].plugin.distribution == "butter-first"
    (problem,) = host.problems
    assert problem.distribution == "butter-second"
    assert "scheme name 'dup' is already provided by butter-first" in problem.message


def test_duplicate_entry_point_name_is_reported_not_skipped_silently(install, only):
    install("butter-one", "one_plugin", GOOD.format(cls="OneKind", scheme="one"), entry_name="same")
    install("butter-two", "two_plugin", GOOD.format(cls="TwoKind", scheme="two"), entry_name="same")
    host = only("butter-one", "butter-two")
    assert len(host.problems) == 1
    assert "entry point name 'same' is already used" in host.problems[0].message


def test_exception_while_registering_is_contained(install, only):
    install(
        "butter-raises",
        "raises_plugin",
        "from butter_core import hookimpl\n@hookimpl\ndef butter_register_cache_schemes(register):\n    raise RuntimeError('boom')\n",
    )
    host = only("butter-raises")
    assert "failed while registering: RuntimeError: boom" in host.problems[0].message


def test_load_plugins_env_restricts(install, only):
    install("butter-good", "good_plugin", GOOD.format(cls="GoodKind", scheme="good"))
    host = only("butter-nothing-matches")
    assert host.schemes == {} and host.problems == []
    assert list(host.plugins) == ["window"]


def test_no_scheme_installed_gives_install_command(only):
    host = only()
    with pytest.raises(UnknownSchemeError, match="installed schemes: none.*pip install butter-raw"):
        make_layer_caches(Raw(), [LayerSpec(1, 64, 16)], host=host)
    with pytest.raises(UnknownSchemeError, match="'aura4v2'.*pip install butter-aura"):
        host.parse_kv_cache("aura4v2")


def test_eviction_only_plugin_registers(install, only):
    source = """
    import attrs
    from butter_core import Eviction, EvictionPolicy, hookimpl

    @attrs.frozen
    class KeepAll(Eviction):
        pass

    @hookimpl
    def butter_register_eviction_policies(register):
        register(EvictionPolicy(name="keep-all", kind=KeepAll, wrap=lambda config, create, specs: create(specs)))
    """
    install("butter-keepall", "keepall_plugin", source)
    host = only("butter-keepall")
    assert host.problems == []
    assert host.plugins["keepall_plugin"].evictions == ["keep-all"]
