"""``Aura``: the configuration of butter-aura's caches (key and value code widths)."""

from __future__ import annotations

import re
from typing import ClassVar

import attrs

from butter_core.plugin_api import CacheKind, ConfigError, one_of

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
