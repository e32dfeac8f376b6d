"""Configuration as data: which KV cache scheme, which eviction policy, which load options.

Every class here is a frozen attrs class validated on construction, so an invalid
configuration fails where it is written, with a message that says what is valid.

`CacheKind` is open: a third-party scheme defines its own subclass (with a ``scheme``
class attribute naming the scheme that creates it) and registers it through the
``butter_register_cache_schemes`` hook; core never needs editing.
"""

from __future__ import annotations

from typing import ClassVar

import attrs

from butter_core.errors import ConfigError


def positive(name: str):
    """An attrs validator: ``name`` is None or a positive int, else ConfigError."""
    def check(instance, attribute, value):
        if value is None:
            return
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{type(instance).__name__}.{name} must be a positive integer, got {value!r}")

    return check


def one_of(name: str, valid: tuple):
    """An attrs validator: the value is one of ``valid``, else ConfigError listing them."""
    def check(instance, attribute, value):
        if value not in valid:
            listed = ", ".join(str(v) for v in valid)
            raise ConfigError(f"{type(instance).__name__}.{name} must be one of {listed}; got {value!r}")

    return check


@attrs.frozen
class CacheKind:
    """Base of every KV cache configuration.

    Subclasses set ``scheme`` to the registered scheme name that creates their caches
    and implement ``__str__`` as the CLI string that parses back to an equal kind.
    ``check_layer`` rejects parameters that only fail for a given layer shape (a group
    size that does not divide head_dim, say).
    """

    scheme: ClassVar[str] = ""

    def check_layer(self, head_dim: int) -> None:
        """Raise ConfigError if this kind cannot store vectors of ``head_dim``."""

    def __str__(self) -> str:  # pragma: no cover - every concrete kind overrides it
        return self.scheme


@attrs.frozen
class Eviction:
    """Base of every eviction configuration; a policy plugin subclasses it (core's is ``Window``)."""


@attrs.frozen
class Window(Eviction):
    """Sliding-window eviction: ``keep`` sink positions pinned, then a FIFO ring of ``max_size - keep``."""

    max_size: int = attrs.field(validator=positive("max_size"))
    keep: int = attrs.field(default=4)

    @keep.validator
    def _check_keep(self, attribute, value):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"Window.keep must be a non-negative integer, got {value!r}")
        if value >= self.max_size:
            raise ConfigError(
                f"Window.keep ({value}) must be smaller than Window.max_size ({self.max_size}): "
                "at least one ring slot is needed for new tokens"
            )

    @property
    def ring_size(self) -> int:
        """How many slots rotate (the non-sink part of the window)."""
        return self.max_size - self.keep

    # The window's slot arithmetic, shared by ``WindowCache`` and batched storage's ``Placement``.

    def slot_of(self, position: int) -> int:
        """The slot that holds ``position`` while it is live."""
        return position if position < self.keep else self.keep + (position - self.keep) % self.ring_size

    def ring_position(self, slot, newest):
        """The position a ring slot holds once ``newest`` (the last position written, past the
        window) is in; ints or arrays."""
        return newest - ((newest - self.keep) - (slot - self.keep)) % self.ring_size

    def survivors(self, first: int, last: int) -> list[int]:
        """The positions of ``[first, last)`` still live once ``last - 1`` is written: sinks and the ring's newest."""
        return list(range(first, min(self.keep, last))) + list(range(max(self.keep, first, last - self.ring_size), last))

    def visible(self, keys, queries):
        """Whether a query at position ``queries`` sees a key at ``keys`` (arrays broadcast): causal,
        and a sink or within the ring behind it."""
        return (keys <= queries) & ((keys < self.keep) | (keys > queries - self.ring_size))

    def __str__(self) -> str:
        return f"window(max_size={self.max_size}, keep={self.keep})"


DEFAULT_KV_CACHE = "raw"
"""The scheme attention layers get when ``LoadOptions.kv_cache`` is None (butter-raw)."""
DEFAULT_STATE_CACHE = "ssm"
"""The scheme recurrent layers get when ``LoadOptions.state_cache`` is None (butter-ssm)."""


def parsed_kind(value):
    """An attrs converter: a scheme's CLI string (``"affine8"``) parsed by the installed plugins;
    a kind or None as it is."""
    if isinstance(value, str):
        from butter_core.plugins import get_plugin_host  # plugins imports this module

        return get_plugin_host().parse_kv_cache(value)
    return value


def _check_kind(instance, attribute, value):
    if value is not None and not isinstance(value, CacheKind):
        raise ConfigError(
            f"LoadOptions.{attribute.name} must be None (the default scheme), a scheme's CLI string such as "
            f"'affine8', or a CacheKind (an installed scheme's kind, as parse_kv_cache returns); got {value!r}"
        )


@attrs.frozen
class LoadOptions:
    """What ``Model.load`` needs beyond the model: cache schemes, eviction, context cap, prefill chunk.

    ``kv_cache`` is the scheme of attention layers (None: ``DEFAULT_KV_CACHE``) and
    ``kv_eviction`` bounds them; ``state_cache`` is the scheme of recurrent layers (Mamba2,
    gated delta; None: ``DEFAULT_STATE_CACHE``), which eviction never touches. Either
    scheme may be given as its CLI string; it is parsed here, so an unknown or invalid one
    fails where it is written.
    """

    kv_cache: CacheKind | None = attrs.field(default=None, converter=parsed_kind, validator=_check_kind)
    kv_eviction: Eviction | None = attrs.field(default=None)
    max_context_length: int | None = attrs.field(default=None, validator=positive("max_context_length"))
    state_cache: CacheKind | None = attrs.field(default=None, converter=parsed_kind, validator=_check_kind)
    prefill_chunk: int | None = attrs.field(default=None, validator=positive("prefill_chunk"))
    """Prompt tokens per forward pass during prefill (None: ``engine.default_prefill_chunk()``,
    chosen by the device and its memory)."""

    @kv_eviction.validator
    def _check_eviction(self, attribute, value):
        if value is not None and not isinstance(value, Eviction):
            raise ConfigError(
                f"LoadOptions.kv_eviction must be None, Window(max_size, keep) or a plugin's Eviction, got {value!r}"
            )
