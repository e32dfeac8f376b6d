"""Loading, validating and looking up butter plugins.

A plugin is a module found through the ``butter.caches`` entry-point group (or
registered by hand, as tests do). Loading never lets one plugin break another: a
plugin that fails to import, implements no registration hook, implements a hook with arguments
the spec does not have, implements an unknown ``butter_*`` hook, raises while
registering, or claims a scheme name another distribution owns is recorded as a
:class:`PluginProblem` naming its distribution, and left out.

``BUTTER_LOAD_PLUGINS=a,b`` (distribution or entry-point names) restricts which
entry points load; set to the empty string, none do.
"""

from __future__ import annotations

import contextlib
import os
from importlib import metadata

import attrs
import pluggy

from butter_core import hookspecs, window
from butter_core.config import CacheKind
from butter_core.errors import UnknownSchemeError
from butter_core.registry import CacheScheme, EvictionPolicy

LOAD_PLUGINS_ENV = "BUTTER_LOAD_PLUGINS"
CORE = "butter-core"

# Our own schemes, so an error can say what to install.
KNOWN_DISTRIBUTIONS = {"raw": "butter-raw", "affine": "butter-affine", "aura": "butter-aura", "ssm": "butter-ssm"}


@attrs.define
class PluginRecord:
    """One loaded plugin: where it came from and what it provides."""

    name: str
    distribution: str
    version: str
    hooks: list[str]
    schemes: list[str] = attrs.Factory(list)
    evictions: list[str] = attrs.Factory(list)


@attrs.frozen
class PluginProblem:
    """A plugin left out at load time, and why."""

    distribution: str
    entry_point: str
    message: str

    def __str__(self) -> str:
        return f"{self.distribution} ({self.entry_point}): {self.message}"


@attrs.frozen
class RegisteredScheme:
    """A scheme together with the plugin that registered it."""

    scheme: CacheScheme
    plugin: PluginRecord


def allowed_plugins() -> set[str] | None:
    """Names in ``BUTTER_LOAD_PLUGINS``, or None when unset (load everything)."""
    value = os.environ.get(LOAD_PLUGINS_ENV)
    if value is None:
        return None
    return {name.strip() for name in value.split(",") if name.strip()}


class PluginHost:
    """The pluggy manager plus what its plugins registered."""

    def __init__(self, *, entry_points: bool = True):
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.plugins: dict[str, PluginRecord] = {}
        self.schemes: dict[str, RegisteredScheme] = {}
        self.evictions: dict[str, EvictionPolicy] = {}
        self.problems: list[PluginProblem] = []
        self.register(window, name="window", distribution=CORE, version=_version(CORE))
        if entry_points:
            self.load_entry_points()

    # -- loading ----------------------------------------------------------------

    def load_entry_points(self) -> None:
        """Load every plugin of the ``butter.caches`` group that ``BUTTER_LOAD_PLUGINS`` allows."""
        allowed = allowed_plugins()
        for ep in sorted(metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP), key=lambda e: e.name):
            dist = ep.dist.name if ep.dist else "?"
            if allowed is not None and dist not in allowed and ep.name not in allowed:
                continue
            if ep.name in self.plugins:
                owner = self.plugins[ep.name].distribution
                self._problem(dist, ep.name, f"entry point name {ep.name!r} is already used by {owner}; skipped")
                continue
            try:
                plugin = ep.load()
            except Exception as exc:  # noqa: BLE001 - any import failure must be contained
                self._problem(dist, ep.name, f"failed to import {ep.value}: {type(exc).__name__}: {exc}")
                continue
            self.register(plugin, name=ep.name, distribution=dist, version=ep.dist.version if ep.dist else "?")

    def register(self, plugin, *, name: str, distribution: str, version: str = "0") -> bool:
        """Validate and register ``plugin``; on any failure record a problem and return False."""
        try:
            self.pm.register(plugin, name=name)
        except (pluggy.PluginValidationError, ValueError) as exc:
            self._problem(distribution, name, f"invalid plugin: {exc}")
            return False
        callers = self.pm.get_hookcallers(plugin) or []
        unknown = sorted(c.name for c in callers if c.spec is None)
        registers = {c.name for c in callers} & set(hookspecs.REGISTRATION_HOOKS)
        if unknown or not registers:
            self.pm.unregister(plugin)
            why = [] if registers else [f"implements none of the registration hooks {', '.join(hookspecs.REGISTRATION_HOOKS)}"]
            why += [f"implements unknown hook {', '.join(unknown)} (no such hook spec)"] if unknown else []
            self._problem(distribution, name, "; ".join(why))
            return False
        record = PluginRecord(name, distribution, version, sorted(c.name for c in callers))
        schemes: dict[str, RegisteredScheme] = {}
        evictions: dict[str, EvictionPolicy] = {}
        try:
            self._call(plugin, "butter_register_cache_schemes", lambda s: self._add_scheme(s, record, schemes))
            self._call(plugin, "butter_register_eviction_policies", lambda p: self._add_eviction(p, evictions))
        except Exception as exc:  # noqa: BLE001 - a broken plugin must not break the others
            self.pm.unregister(plugin)
            self._problem(distribution, name, f"failed while registering: {type(exc).__name__}: {exc}")
            return False
        record.schemes, record.evictions = sorted(schemes), sorted(evictions)
        self.schemes.update(schemes)
        self.evictions.update(evictions)
        self.plugins[name] = record
        return True

    def unregister(self, name: str) -> None:
        """Remove a plugin and everything it registered."""
        record = self.plugins.pop(name)
        for scheme in record.schemes:
            del self.schemes[scheme]
        for policy in record.evictions:
            del self.evictions[policy]
        self.pm.unregister(name=name)

    def _call(self, plugin, hook_name: str, register) -> None:
        for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
            if impl.plugin is plugin:
                impl.function(register=register)

    def _add_scheme(self, scheme, record: PluginRecord, pending: dict) -> None:
        if not isinstance(scheme, CacheScheme):
            raise TypeError(f"register() takes a butter_core.CacheScheme, got {type(scheme).__name__}")
        owner = self.schemes.get(scheme.name)
        if owner is not None or scheme.name in pending:
            holder = owner.plugin.distribution if owner else record.distribution
            raise ValueError(f"scheme name {scheme.name!r} is already provided by {holder}")
        if not (isinstance(scheme.kind_type, type) and issubclass(scheme.kind_type, CacheKind)):
            raise TypeError(f"scheme {scheme.name!r}: kind_type must be a CacheKind subclass")
        pending[scheme.name] = RegisteredScheme(scheme, record)

    def _add_eviction(self, policy, pending: dict) -> None:
        if not isinstance(policy, EvictionPolicy):
            raise TypeError(f"register() takes a butter_core.EvictionPolicy, got {type(policy).__name__}")
        if policy.name in self.evictions or policy.name in pending:
            raise ValueError(f"eviction policy {policy.name!r} is already registered")
        pending[policy.name] = policy

    def _problem(self, distribution: str, entry_point: str, message: str) -> None:
        self.problems.append(PluginProblem(distribution, entry_point, message))

    # -- lookups ----------------------------------------------------------------

    def parse_kv_cache(self, text: str) -> CacheKind:
        """The kind a CLI string such as ``affine4`` or ``aura4v2`` names."""
        for registered in self.schemes.values():
            kind = registered.scheme.parse(text)
            if kind is not None:
                return kind
        raise UnknownSchemeError(self._unknown_message(repr(text), text))

    def scheme_for(self, kind: CacheKind) -> CacheScheme:
        """The installed scheme that creates caches of ``kind``."""
        registered = self.schemes.get(kind.scheme)
        if registered is None or not isinstance(kind, registered.scheme.kind_type):
            raise UnknownSchemeError(self._unknown_message(f"{kind} ({type(kind).__name__})", kind.scheme))
        return registered.scheme

    def eviction_for(self, config) -> EvictionPolicy:
        """The policy registered for an eviction configuration such as ``Window(...)``."""
        for policy in self.evictions.values():
            if isinstance(config, policy.kind):
                return policy
        raise UnknownSchemeError(f"no eviction policy handles {config!r}; registered: {sorted(self.evictions)}")

    def _unknown_message(self, what: str, text: str) -> str:
        installed = ", ".join(
            f"{name} ({r.plugin.distribution} {r.plugin.version}: {', '.join(r.scheme.examples)})"
            for name, r in sorted(self.schemes.items())
        ) or "none"
        message = f"unknown KV cache scheme {what}; installed schemes: {installed}"
        for prefix, dist in KNOWN_DISTRIBUTIONS.items():
            if text.startswith(prefix) and prefix not in self.schemes:
                message += f". {prefix!r} schemes come from {dist}: pip install {dist}"
        if self.problems:
            message += ". Plugins that failed to load: " + "; ".join(str(p) for p in self.problems)
        return message


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "0+source"


_host: PluginHost | None = None


def get_plugin_host() -> PluginHost:
    """The process-wide host, loading entry points on first use."""
    global _host
    if _host is None:
        _host = PluginHost()
    return _host


def reset_plugin_host() -> None:
    """Forget the process-wide host (after changing ``BUTTER_LOAD_PLUGINS``, say)."""
    global _host
    _host = None


@contextlib.contextmanager
def temporary_plugin(plugin, *, name: str, distribution: str = "test", host: PluginHost | None = None):
    """Register ``plugin`` for the duration of a ``with`` block (tests)."""
    host = host or get_plugin_host()
    if not host.register(plugin, name=name, distribution=distribution):
        raise AssertionError(f"plugin {name} did not register: {host.problems[-1]}")
    try:
        yield host
    finally:
        host.unregister(name)
