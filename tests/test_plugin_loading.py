"""Plugin loading: real entry points in real (temporary) distributions, each failure contained and named."""

from __future__ import annotations

import importlib
import sys
from importlib import metadata
import textwrap
from typing import ClassVar

import attrs
import pytest

from butter_core import CacheKind, PluginError, UnknownSchemeError, Window, make_layer_caches
from butter_core.cache import LayerSpec
from butter_core.errors import AmbiguousSchemeError
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


def test_a_scheme_name_two_distributions_register_goes_to_neither(install, only):
    """Not decided by load order: the impostor's entry point sorts first here."""
    install("butter-dup", "dup_plugin", GOOD.format(cls="DupKind", scheme="dup"))
    install("aaa-impostor", "aaa_plugin", GOOD.format(cls="ImpostorKind", scheme="dup"), entry_name="aaa")
    install("butter-good", "good_plugin", GOOD.format(cls="GoodKind", scheme="good"))
    host = only("butter-dup", "aaa-impostor", "butter-good")
    assert "dup" not in host.schemes and list(host.contested) == ["dup"]
    assert sorted(p.distribution for p in host.problems) == ["aaa-impostor", "butter-dup"]
    choose = "BUTTER_LOAD_PLUGINS=aaa-impostor,butter-good or BUTTER_LOAD_PLUGINS=butter-dup,butter-good"
    assert all(choose in p.message and "is registered by aaa-impostor 1.2.3 (entry point aaa) and by butter-dup "
               "1.2.3 (entry point dup_plugin); butter uses none of them until you choose" in p.message
               for p in host.problems)  # fmt: skip
    for ask in (lambda: host.parse_kv_cache("dup"), lambda: host.scheme_for(sys.modules["dup_plugin"].DupKind())):
        with pytest.raises(AmbiguousSchemeError, match=choose):
            ask()
    assert str(host.parse_kv_cache("good")) == "good"  # the others keep working
    chosen = only("butter-dup", "butter-good")
    assert chosen.schemes["dup"].plugin.distribution == "butter-dup" and chosen.problems == []
    host.unregister("aaa")  # the other claimant keeps the name
    assert host.schemes["dup"].plugin.distribution == "butter-dup"


def test_a_string_two_schemes_parse_is_refused_naming_both(install, only):
    install("butter-good", "good_plugin", GOOD.format(cls="GoodKind", scheme="good"))
    greedy = GOOD.format(cls="GreedyKind", scheme="greedy").replace(
        'if t == "greedy"', 'if t in ("greedy", "good")')
    install("butter-greedy", "greedy_plugin", greedy)
    host = only("butter-good", "butter-greedy")
    assert host.problems == []
    with pytest.raises(AmbiguousSchemeError, match="'good' is claimed by butter-good .* and by butter-greedy"):
        host.parse_kv_cache("good")
    assert str(host.parse_kv_cache("greedy")) == "greedy"


def test_two_distributions_may_use_one_entry_point_name(install, only):
    install("butter-one", "one_plugin", GOOD.format(cls="OneKind", scheme="one"), entry_name="same")
    install("butter-two", "two_plugin", GOOD.format(cls="TwoKind", scheme="two"), entry_name="same")
    host = only("butter-one", "butter-two")
    assert host.problems == [] and {"one", "two"} <= set(host.schemes)
    assert sorted(r.distribution for r in host.plugins.values()) == ["butter-core", "butter-one", "butter-two"]


BROKEN_PARSE = GOOD.replace("parse=lambda t: {cls}() if t == \"{scheme}\" else None", "parse=parse") + """
def parse(text):
    if text == "{scheme}":
        return {cls}()
    {broken}
"""


def test_a_parse_that_raises_on_strings_not_its_own_is_left_out_at_load(install, only):
    install("butter-good", "good_plugin", GOOD.format(cls="GoodKind", scheme="good"))
    install("butter-badparse", "badparse_plugin",
            BROKEN_PARSE.format(cls="BadKind", scheme="bad", broken="raise KeyError(text)"))  # fmt: skip
    host = only("butter-good", "butter-badparse")
    (problem,) = host.problems
    assert problem.distribution == "butter-badparse" and "failed while registering: KeyError" in problem.message
    assert str(host.parse_kv_cache("good")) == "good" and "bad" not in host.schemes


def test_a_parse_that_raises_later_is_contained_and_recorded(install, only):
    install("butter-good", "good_plugin", GOOD.format(cls="GoodKind", scheme="good"))
    broken = BROKEN_PARSE.format(cls="LateKind", scheme="late", broken="if text == 'good': raise RuntimeError('boom')")
    install("butter-late", "late_plugin", broken)
    host = only("butter-good", "butter-late")
    assert host.problems == []
    assert str(host.parse_kv_cache("good")) == "good"
    (problem,) = host.problems
    assert problem.distribution == "butter-late"
    assert problem.message == "scheme 'late': parse('good') raised RuntimeError: boom"
    with pytest.raises(UnknownSchemeError, match="Plugin problems: butter-late"):
        host.parse_kv_cache("nosuch")


def test_a_parse_that_does_not_round_trip_its_examples_is_left_out(install, only):
    install("butter-liar", "liar_plugin", GOOD.format(cls="LiarKind", scheme="liar").replace(
        'examples=("liar",)', 'examples=("liar", "other")'))  # fmt: skip
    host = only("butter-liar")
    assert "parse('other') must return a LiarKind" in host.problems[0].message and "liar" not in host.schemes


@pytest.mark.parametrize(
    ("create", "message"),
    [
        ("lambda kind, specs: 1 / 0", r"scheme 'crash' of butter-crash 1.2.3 \(entry point crash_plugin\) failed: "
                                      "ZeroDivisionError"),
        ("lambda kind, specs: ['not a cache'] * len(specs)", "must return a list of 2 LayerCache objects"),
    ],
)  # fmt: skip
def test_a_failing_create_is_a_plugin_error_naming_the_distribution(install, only, create, message):
    install("butter-good", "good_plugin", GOOD.format(cls="GoodKind", scheme="good"))
    install("butter-crash", "crash_plugin", GOOD.format(cls="CrashKind", scheme="crash").replace(
        "create=lambda kind, specs: []", f"create={create}"))  # fmt: skip
    host = only("butter-good", "butter-crash")
    specs = [LayerSpec(1, 64, 16), LayerSpec(1, 64, 16, layer_index=1)]
    with pytest.raises(PluginError, match=message):
        make_layer_caches(host.parse_kv_cache("crash"), specs, host=host)
    with pytest.raises(PluginError, match="must return a list of 2 LayerCache"):  # good's create returns []
        make_layer_caches(host.parse_kv_cache("good"), specs, host=host)


def test_core_eviction_policies_cannot_be_taken_over(install, only):
    source = """
    from butter_core import EvictionPolicy, Window, hookimpl

    @hookimpl
    def butter_register_eviction_policies(register):
        register(EvictionPolicy(name="{name}", kind=Window, wrap=lambda config, create, specs: create(specs)))
    """
    install("butter-thief", "thief_plugin", source.format(name="window"))
    install("butter-sneak", "sneak_plugin", source.format(name="sneaky"))
    host = only("butter-thief", "butter-sneak")
    assert [p.distribution for p in host.problems] == ["butter-sneak", "butter-thief"]
    assert all("eviction policy 'window' (Window) belongs to butter-core" in p.message for p in host.problems)
    assert host.eviction_for(Window(8)) is host.evictions["window"] and list(host.evictions) == ["window"]


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


@attrs.frozen
class RawKind(CacheKind):
    scheme: ClassVar[str] = "raw"


def test_no_scheme_installed_gives_install_command(only, monkeypatch):
    monkeypatch.setattr(metadata, "entry_points", lambda group: [])  # nothing of ours is installed
    host = only()
    with pytest.raises(UnknownSchemeError, match="installed schemes: none.*pip install butter-raw"):
        host.parse_kv_cache("raw")
    with pytest.raises(UnknownSchemeError, match="installed schemes: none.*pip install butter-raw"):
        make_layer_caches(RawKind(), [LayerSpec(1, 64, 16)], host=host)  # a kind whose plugin went missing
    with pytest.raises(UnknownSchemeError, match="'aura4v2'.*pip install butter-aura"):
        host.parse_kv_cache("aura4v2")


def test_a_scheme_filtered_out_is_said_to_be_installed(install, only):
    install("butter-good", "good_plugin", GOOD.format(cls="GoodKind", scheme="good"))
    install("butter-raw-lookalike", "rawish_plugin", GOOD.format(cls="RawishKind", scheme="rawish"))
    host = only("nosuch")
    assert ("butter-good", "good_plugin") in host.left_out
    with pytest.raises(UnknownSchemeError) as info:
        host.parse_kv_cache("good")
    message = str(info.value)
    assert "installed schemes: none" in message
    assert "BUTTER_LOAD_PLUGINS='nosuch' leaves out the installed " in message and "butter-good" in message
    assert "name them there, or unset it" in message
    raw_installed = any(dist == "butter-raw" for dist, _ in host.left_out)
    with pytest.raises(UnknownSchemeError) as info:
        host.parse_kv_cache("raw")
    assert ("pip install butter-raw" in str(info.value)) is not raw_installed


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
