"""``Affine``: the configuration of butter-affine's caches (code width and group size)."""

from __future__ import annotations

from typing import ClassVar

import attrs

from butter_core.plugin_api import CacheKind, ConfigError, one_of

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
