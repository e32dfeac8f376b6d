"""Loading, validating and looking up butter plugins.

A plugin is a module found through the ``butter.caches`` entry-point group (or
registered by hand, as tests do). Loading never lets one plugin break another: a
plugin that fails to import, implements no registration hook, implements a hook with arguments
the spec does not have, implements an unknown ``butter_*`` hook, raises while
registering, or registers a scheme whose ``parse`` fails on its own examples is recorded as a
:class:`PluginProblem` naming its distribution, and left out.

Names are never decided by load order. A scheme name registered by two distributions is
*contested*: neither provides it, ``butter plugins`` names both, and asking for it says
how to choose with ``BUTTER_LOAD_PLUGINS``. A CLI string that two schemes' ``parse`` both
claim is refused the same way. The eviction policies of butter-core cannot be taken over.

Plugin code that runs after loading (``parse``, ``check_layer``, ``create``, an eviction
policy's ``wrap``) is contained too: a ``ButterError`` it raises on purpose passes through,
anything else becomes a ``PluginError`` naming the distribution (or, in ``parse``, a
problem recorded while the other schemes keep answering).

``BUTTER_LOAD_PLUGINS=a,b`` (distribution or entry-point names) restricts which
entry points load; set to the empty string, none do. What it leaves out is listed in
``left_out``, so messages can say that a scheme is installed but filtered out.
"""

from __future__ import annotations

import contextlib
import os
from importlib import metadata

import attrs
import pluggy

from butter_core import hookspecs, window
from butter_core.cache import LayerCache, LayerSpec
from butter_core.config import CacheKind, Eviction
from butter_core.errors import AmbiguousSchemeError, ButterError, ConfigError, PluginError, UnknownSchemeError
from butter_core.registry import CacheScheme, EvictionPolicy

LOAD_PLUGINS_ENV = "BUTTER_LOAD_PLUGINS"
CORE = "butter-core"

# Our own schemes, so an error can say what to install.
KNOWN_DISTRIBUTIONS = {"raw": "butter-raw", "affine": "butter-affine", "aura": "butter-aura", "ssm": "butter-ssm"}

PROBE = "\x00 not a scheme name"
"""A string every scheme's ``parse`` must answer with None (checked when the scheme registers)."""


@attrs.define
class PluginRecord:
    """One loaded plugin: where it came from and what it provides."""

    name: str
    distribution: str
    version: str
    hooks: list[str]
    schemes: list[str] = attrs.Factory(list)
    evictions: list[str] = attrs.Factory(list)

    def __str__(self) -> str:
        return f"{self.distribution} {self.version} (entry point {self.name})"


@attrs.frozen
class PluginProblem:
    """A plugin left out at load time, or a failure of its code contained later, and why."""

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


@attrs.frozen
class RegisteredPolicy:
    """An eviction policy together with the plugin that registered it."""

    policy: EvictionPolicy
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
        self.left_out: list[tuple[str, str]] = []
        """(distribution, entry point) of every installed plugin ``BUTTER_LOAD_PLUGINS`` left out."""
        self._scheme_claims: dict[str, list[RegisteredScheme]] = {}
        self._policy_claims: dict[str, list[RegisteredPolicy]] = {}
        self._problems: list[PluginProblem] = []
        self.register(window, name="window", distribution=CORE, version=_version(CORE))
        if entry_points:
            self.load_entry_points()

    # -- what is registered -------------------------------------------------------

    @property
    def schemes(self) -> dict[str, RegisteredScheme]:
        """Scheme name -> its scheme, for every name exactly one plugin registered."""
        return {name: claims[0] for name, claims in self._scheme_claims.items() if len(claims) == 1}

    @property
    def contested(self) -> dict[str, list[RegisteredScheme]]:
        """Scheme name -> every registration of it, for names more than one plugin registered."""
        return {name: list(claims) for name, claims in self._scheme_claims.items() if len(claims) > 1}

    @property
    def evictions(self) -> dict[str, EvictionPolicy]:
        """Policy name -> policy, for every name exactly one plugin registered."""
        return {name: claims[0].policy for name, claims in self._policy_claims.items() if len(claims) == 1}

    @property
    def problems(self) -> list[PluginProblem]:
        """Plugins left out, plugin code that failed, and every claimant of a contested name."""
        contests = [
            PluginProblem(claim.plugin.distribution, claim.plugin.name, self._contest_message(kind, name, claims))
            for kind, contested in (("scheme", self._scheme_claims), ("eviction policy", self._policy_claims))
            for name, claims in contested.items()
            if len(claims) > 1
            for claim in claims
        ]
        return self._problems + contests

    def scheme_of(self, record: PluginRecord, name: str) -> CacheScheme:
        """The scheme ``name`` as the plugin ``record`` registered it (contested or not)."""
        return next(claim.scheme for claim in self._scheme_claims[name] if claim.plugin is record)

    # -- loading ----------------------------------------------------------------

    def load_entry_points(self) -> None:
        """Load every plugin of the ``butter.caches`` group that ``BUTTER_LOAD_PLUGINS`` allows."""
        allowed = allowed_plugins()
        for ep in sorted(metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP), key=lambda e: e.name):
            dist = ep.dist.name if ep.dist else "?"
            if allowed is not None and dist not in allowed and ep.name not in allowed:
                self.left_out.append((dist, ep.name))
                continue
            try:
                plugin = ep.load()
            except Exception as exc:  # noqa: BLE001 - any import failure must be contained
                self._problem(dist, ep.name, f"failed to import {ep.value}: {type(exc).__name__}: {exc}")
                continue
            # Two distributions may use one entry-point name; pluggy needs unique names, and
            # neither is skipped for it (which one came first says nothing).
            name = ep.name if ep.name not in self.plugins else f"{ep.name}@{dist}"
            self.register(plugin, name=name, distribution=dist, version=ep.dist.version if ep.dist else "?")

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
        policies: dict[str, RegisteredPolicy] = {}
        try:
            self._call(plugin, "butter_register_cache_schemes", lambda s: self._add_scheme(s, record, schemes))
            self._call(plugin, "butter_register_eviction_policies", lambda p: self._add_policy(p, record, policies))
        except Exception as exc:  # noqa: BLE001 - a broken plugin must not break the others
            self.pm.unregister(plugin)
            self._problem(distribution, name, f"failed while registering: {type(exc).__name__}: {exc}")
            return False
        record.schemes, record.evictions = sorted(schemes), sorted(policies)
        for scheme_name, registered in schemes.items():
            self._scheme_claims.setdefault(scheme_name, []).append(registered)
        for policy_name, registered_policy in policies.items():
            self._policy_claims.setdefault(policy_name, []).append(registered_policy)
        self.plugins[name] = record
        return True

    def unregister(self, name: str) -> None:
        """Remove a plugin and everything it registered (a name it contested goes to the other claimant)."""
        record = self.plugins.pop(name)
        for claims in (self._scheme_claims, self._policy_claims):
            for key in list(claims):
                claims[key] = [claim for claim in claims[key] if claim.plugin is not record]
                if not claims[key]:
                    del claims[key]
        self.pm.unregister(name=name)

    def _call(self, plugin, hook_name: str, register) -> None:
        for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
            if impl.plugin is plugin:
                impl.function(register=register)

    def _add_scheme(self, scheme, record: PluginRecord, pending: dict) -> None:
        if not isinstance(scheme, CacheScheme):
            raise TypeError(f"register() takes a butter_core.CacheScheme, got {type(scheme).__name__}")
        if scheme.name in pending:
            raise ValueError(f"scheme name {scheme.name!r} is registered twice")
        if not (isinstance(scheme.kind_type, type) and issubclass(scheme.kind_type, CacheKind)):
            raise TypeError(f"scheme {scheme.name!r}: kind_type must be a CacheKind subclass")
        if scheme.kind_type.scheme != scheme.name:
            raise ValueError(
                f"scheme {scheme.name!r}: its kind_type {scheme.kind_type.__name__} names the scheme "
                f"{scheme.kind_type.scheme!r} (CacheKind.scheme must be the registered name)"
            )
        if not scheme.layer_types or not all(isinstance(t, str) and t for t in scheme.layer_types):
            raise ValueError(f"scheme {scheme.name!r}: layer_types must name the layer types it stores, got "
                             f"{scheme.layer_types!r}")
        if not scheme.examples:
            raise ValueError(f"scheme {scheme.name!r}: examples must name at least one CLI string")
        for example in scheme.examples:
            kind = scheme.parse(example)
            if not isinstance(kind, scheme.kind_type) or scheme.parse(str(kind)) != kind:
                raise ValueError(
                    f"scheme {scheme.name!r}: parse({example!r}) must return a {scheme.kind_type.__name__} whose "
                    f"str() parses back to it; got {kind!r}"
                )
        if scheme.parse(PROBE) is not None:
            raise ValueError(f"scheme {scheme.name!r}: parse must return None for strings that are not its own")
        pending[scheme.name] = RegisteredScheme(scheme, record)

    def _add_policy(self, policy, record: PluginRecord, pending: dict) -> None:
        if not isinstance(policy, EvictionPolicy):
            raise TypeError(f"register() takes a butter_core.EvictionPolicy, got {type(policy).__name__}")
        if not (isinstance(policy.kind, type) and issubclass(policy.kind, Eviction)):
            raise TypeError(f"eviction policy {policy.name!r}: kind must be an Eviction subclass")
        if policy.name in pending:
            raise ValueError(f"eviction policy {policy.name!r} is registered twice")
        for claims in self._policy_claims.values():
            core = claims[0]
            if core.plugin.distribution == CORE and (core.policy.name == policy.name or core.policy.kind is policy.kind):
                raise ValueError(f"eviction policy {core.policy.name!r} ({core.policy.kind.__name__}) belongs to {CORE}")
        pending[policy.name] = RegisteredPolicy(policy, record)

    def _problem(self, distribution: str, entry_point: str, message: str) -> None:
        self._problems.append(PluginProblem(distribution, entry_point, message))

    # -- lookups ----------------------------------------------------------------

    def parse_kv_cache(self, text: str) -> CacheKind:
        """The kind a CLI string such as ``affine4`` or ``aura4v2`` names.

        Every scheme's ``parse`` is asked; one must claim the string. A ``ButterError`` a
        scheme raises (``affine5``: no such width) is raised when no scheme claims it.
        """
        if not isinstance(text, str):
            raise ConfigError(
                f"a KV cache scheme is named by a string such as 'raw', 'affine8' or 'aura4v2'; "
                f"got {text!r} ({type(text).__name__})"
            )
        found: list[tuple[RegisteredScheme, CacheKind]] = []
        refusal: ButterError | None = None
        for claims in self._scheme_claims.values():
            for claim in claims:
                try:
                    kind = claim.scheme.parse(text)
                except ButterError as exc:
                    refusal = refusal or exc
                    continue
                except Exception as exc:  # noqa: BLE001 - one broken parse must not break the others
                    self._problem(claim.plugin.distribution, claim.plugin.name,
                                  f"scheme {claim.scheme.name!r}: parse({text!r}) raised {type(exc).__name__}: {exc}")  # fmt: skip
                    continue
                if kind is None:
                    continue
                if not isinstance(kind, claim.scheme.kind_type):
                    self._problem(claim.plugin.distribution, claim.plugin.name,
                                  f"scheme {claim.scheme.name!r}: parse({text!r}) returned {kind!r}, "
                                  f"not a {claim.scheme.kind_type.__name__}")  # fmt: skip
                    continue
                found.append((claim, kind))
        if len(found) > 1:
            raise AmbiguousSchemeError(
                f"KV cache scheme {text!r} is claimed by {' and by '.join(_claimant(c) for c, _ in found)}; butter uses "
                f"none of them until you choose: {self._choices([c for c, _ in found])}"
            )
        if found:
            claim, kind = found[0]
            self._require_uncontested(claim.scheme.name)
            return kind
        if refusal is not None:
            raise refusal
        raise UnknownSchemeError(self._unknown_message(repr(text), text))

    def scheme_for(self, kind: CacheKind) -> CacheScheme:
        """The installed scheme that creates caches of ``kind``."""
        return self._registered_for(kind).scheme

    def create_caches(self, kind: CacheKind, specs) -> list[LayerCache]:
        """One cache per spec from ``kind``'s scheme, its plugin's failures contained (``PluginError``)."""
        registered = self._registered_for(kind)
        name = registered.scheme.name
        with self._plugin_code(registered.plugin, f"scheme {name!r}"):
            for spec in specs:
                if isinstance(spec, LayerSpec):
                    kind.check_layer(spec.head_dim)
            caches = registered.scheme.create(kind, specs)
        return self._checked_caches(caches, len(specs), f"scheme {name!r} of {registered.plugin}")

    def wrap_caches(self, config: Eviction, create_inner, specs) -> list[LayerCache]:
        """The caches of ``specs`` under the eviction policy of ``config``, its plugin's failures contained."""
        registered = self._policy_for(config)
        with self._plugin_code(registered.plugin, f"eviction policy {registered.policy.name!r}"):
            caches = registered.policy.wrap(config, create_inner, specs)
        return self._checked_caches(caches, len(specs), f"eviction policy {registered.policy.name!r} of {registered.plugin}")

    def eviction_for(self, config) -> EvictionPolicy:
        """The policy registered for an eviction configuration such as ``Window(...)``."""
        return self._policy_for(config).policy

    def _registered_for(self, kind: CacheKind) -> RegisteredScheme:
        self._require_uncontested(kind.scheme)
        registered = self.schemes.get(kind.scheme)
        if registered is None or not isinstance(kind, registered.scheme.kind_type):
            raise UnknownSchemeError(self._unknown_message(f"{kind} ({type(kind).__name__})", kind.scheme))
        return registered

    def _policy_for(self, config) -> RegisteredPolicy:
        matches = [claims for claims in self._policy_claims.values() if isinstance(config, claims[0].policy.kind)]
        if len(matches) > 1 or (matches and len(matches[0]) > 1):
            claimants = [claim for claims in matches for claim in claims]
            raise AmbiguousSchemeError(
                f"eviction {config!r} is handled by {' and by '.join(_claimant(c) for c in claimants)}; butter uses "
                f"none of them until you choose: {self._choices(claimants)}"
            )
        if not matches:
            raise UnknownSchemeError(f"no eviction policy handles {config!r}; registered: {sorted(self.evictions)}")
        return matches[0][0]

    def _require_uncontested(self, name: str) -> None:
        claims = self._scheme_claims.get(name, [])
        if len(claims) > 1:
            raise AmbiguousSchemeError(self._contest_message("scheme", name, claims))

    @contextlib.contextmanager
    def _plugin_code(self, record: PluginRecord, what: str):
        """Let a ``ButterError`` of the plugin's pass; turn anything else into a ``PluginError`` naming it."""
        try:
            yield
        except ButterError:
            raise
        except Exception as exc:  # noqa: BLE001 - a plugin's bug is reported as the plugin's
            raise PluginError(f"{what} of {record} failed: {type(exc).__name__}: {exc}") from exc

    @staticmethod
    def _checked_caches(caches, count: int, what: str) -> list[LayerCache]:
        if not isinstance(caches, list) or len(caches) != count or not all(isinstance(c, LayerCache) for c in caches):
            raise PluginError(f"{what} must return a list of {count} LayerCache objects, one per spec; got {caches!r}")
        return caches

    def _contest_message(self, kind: str, name: str, claims) -> str:
        return (
            f"{kind} name {name!r} is registered by {' and by '.join(_claimant(c) for c in claims)}; butter uses none "
            f"of them until you choose: {self._choices(claims)}"
        )

    def _choices(self, claims) -> str:
        """How to keep each claimant and leave out the others with ``BUTTER_LOAD_PLUGINS`` (by
        distribution, or by entry point where the claimants share one distribution)."""
        theirs = {claim.plugin.distribution for claim in claims}
        by_distribution = len(theirs) == len(claims)
        others = sorted({r.distribution for r in self.plugins.values() if r.distribution not in theirs | {CORE}})
        keep = sorted(claim.plugin.distribution if by_distribution else claim.plugin.name for claim in claims)
        return " or ".join(f"{LOAD_PLUGINS_ENV}={','.join([one, *others])}" for one in keep)

    def _unknown_message(self, what: str, text: str) -> str:
        installed = ", ".join(
            f"{name} ({r.plugin.distribution} {r.plugin.version}: {', '.join(r.scheme.examples)})"
            for name, r in sorted(self.schemes.items())
        ) or "none"
        message = f"unknown KV cache scheme {what}; installed schemes: {installed}"
        left_out = sorted({dist for dist, _ in self.left_out})
        for prefix, dist in KNOWN_DISTRIBUTIONS.items():
            if text.startswith(prefix) and prefix not in self._scheme_claims and dist not in left_out:
                message += f". {prefix!r} schemes come from {dist}: pip install {dist}"
        if left_out:
            message += (
                f". {LOAD_PLUGINS_ENV}={os.environ.get(LOAD_PLUGINS_ENV, '')!r} leaves out the installed "
                f"{', '.join(left_out)}: name them there, or unset it"
            )
        if self.problems:
            message += ". Plugin problems: " + "; ".join(str(p) for p in self.problems)
        return message


def _claimant(claim: RegisteredScheme | RegisteredPolicy) -> str:
    return str(claim.plugin)


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
