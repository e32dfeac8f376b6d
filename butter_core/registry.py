"""What plugins register: cache schemes and eviction policies, as plain data."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

from butter_core.cache import ATTENTION, LayerCache, LayerSpec
from butter_core.config import CacheKind


@attrs.frozen
class CacheScheme:
    """A KV cache scheme offered by a plugin.

    ``name`` is unique across installed distributions. ``parse`` turns a CLI string into
    a kind of ``kind_type`` (or returns None when the string is not this scheme's);
    ``create`` builds one cache per layer spec, and may share buffers among the layers
    of one call. ``kernel_checks`` lists the scheme's GPU kernels with their references
    (``butter_core.kernels.checks.KernelCheck``) for the conformance suite.
    ``layer_types`` are the layers it stores: ``ATTENTION`` (keys and values, the default) or
    recurrent types (``butter_core.recurrent.MAMBA2``, ``GATED_DELTA``, or a third party's).
    ``model_tolerance`` is the relative error of a tiny model's logits against a full
    recompute that the scheme's first example promises (None: exact schemes, or not
    declared — the model matrix then reports the comparison as skipped).
    """

    name: str
    kind_type: type[CacheKind]
    parse: Callable[[str], CacheKind | None]
    create: Callable[[CacheKind, Sequence[LayerSpec]], list[LayerCache]]
    examples: tuple[str, ...]
    description: str = ""
    kernel_checks: Callable[[], Sequence] = attrs.field(default=lambda: ())
    model_tolerance: float | None = None
    layer_types: tuple[str, ...] = (ATTENTION,)


@attrs.frozen
class EvictionPolicy:
    """An eviction policy that decorates the caches of any scheme."""

    name: str
    kind: type
    wrap: Callable[..., list[LayerCache]]
