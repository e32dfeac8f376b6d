"""Configuration as data: which KV cache scheme, which eviction policy, which load options.

Every class here is a frozen attrs class validated on construction, so an invalid
configuration fails where it is written, with a message that says what is valid.

`CacheKind` is open: a third-party scheme defines its own subclass (with a ``scheme``
class attribute naming the scheme that creates it) and registers it through the
``butter_register_cache_schemes`` hook; core never needs editing.
"""

from __future__ import annotations

import re
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


MODEL_DTYPE = None
CACHE_DTYPES = (MODEL_DTYPE, "float16", "bfloat16", "float32")


@attrs.frozen
class Raw(CacheKind):
    """Unquantized K/V in the model's dtype (``dtype=None``) or an explicit float dtype."""

    scheme: ClassVar[str] = "raw"
    dtype: str | None = attrs.field(default=MODEL_DTYPE, validator=one_of("dtype", CACHE_DTYPES))

    def __str__(self) -> str:
        return "raw" if self.dtype is None else f"raw-{self.dtype}"


AFFINE_BITS = (4, 6, 8)
GROUP_SIZES = (32, 64, 128)


def _default_group(bits: int) -> int:
    # The seed's choice: 4-bit K/V loses too much with groups of 64; 8-bit is fine there.
    return 64 if bits == 8 else 32


@attrs.frozen
class Affine(CacheKind):
    """Affine (scale + bias per group) quantized K/V: affine8, affine6, affine4, affine{bits}g{group}."""

    scheme: ClassVar[str] = "affine"
    bits: int = attrs.field(default=8, validator=one_of("bits", AFFINE_BITS))
    group_size: int = attrs.field(validator=one_of("group_size", GROUP_SIZES))

    @group_size.default
    def _group_default(self) -> int:
        return _default_group(self.bits)

    def check_layer(self, head_dim: int) -> None:
        if head_dim % self.group_size:
            raise ConfigError(
                f"{self}: group_size {self.group_size} does not divide head_dim {head_dim}; "
                f"use a group size among {[g for g in GROUP_SIZES if head_dim % g == 0]}"
            )

    def __str__(self) -> str:
        default = self.group_size == _default_group(self.bits)
        return f"affine{self.bits}" if default else f"affine{self.bits}g{self.group_size}"


AURA_BITS = (2, 3, 4, 8)
_AURA_NAME = re.compile(r"aura(\d+)v(\d+)")


@attrs.frozen
class Aura(CacheKind):
    """AURA rotated-codebook K/V with independent key and value bit widths (aura4v2, aura8v4, ...)."""

    scheme: ClassVar[str] = "aura"
    key_bits: int = attrs.field(default=4, validator=one_of("key_bits", AURA_BITS))
    value_bits: int = attrs.field(default=2, validator=one_of("value_bits", AURA_BITS))

    @classmethod
    def named(cls, name: str) -> Aura:
        """The kind for a scheme name such as ``aura4v2``."""
        match = _AURA_NAME.fullmatch(name)
        if not match:
            raise ConfigError(f"AURA scheme names look like aura{{kbits}}v{{vbits}} (e.g. aura4v2); got {name!r}")
        return cls(int(match[1]), int(match[2]))

    def __str__(self) -> str:
        return f"aura{self.key_bits}v{self.value_bits}"


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

    def __str__(self) -> str:
        return f"window(max_size={self.max_size}, keep={self.keep})"


@attrs.frozen
class LoadOptions:
    """What ``Model.load`` needs beyond the model: cache scheme, eviction, context cap."""

    kv_cache: CacheKind = attrs.field(factory=Raw)
    kv_eviction: Eviction | None = attrs.field(default=None)
    max_context_length: int | None = attrs.field(default=None, validator=positive("max_context_length"))

    @kv_cache.validator
    def _check_kind(self, attribute, value):
        if not isinstance(value, CacheKind):
            raise ConfigError(
                f"LoadOptions.kv_cache must be a CacheKind (Raw(), Affine(bits=8), Aura.named('aura4v2'), "
                f"or a plugin's kind), got {value!r}; to parse a CLI string use butter_core.parse_kv_cache"
            )

    @kv_eviction.validator
    def _check_eviction(self, attribute, value):
        if value is not None and not isinstance(value, Eviction):
            raise ConfigError(
                f"LoadOptions.kv_eviction must be None, Window(max_size, keep) or a plugin's Eviction, got {value!r}"
            )
