"""butter-ssm: the cache scheme of recurrent layers (Mamba2 and gated delta rule mixers).

A hybrid model's attention layers take an attention scheme (``--kv-cache``); its recurrent
layers take this one (``--state-cache``, the default). Each layer keeps its convolution's
last inputs and its recurrent state, a size fixed by the layer whatever the context.
"""

from __future__ import annotations

from butter_core.plugin_api import GATED_DELTA, MAMBA2, CacheScheme, hookimpl

from butter_ssm.cache import SSMCache
from butter_ssm.kind import SSM, STATE_DTYPES

_NAMES = {str(SSM(dtype)): SSM(dtype) for dtype in STATE_DTYPES}


def parse(text: str) -> SSM | None:
    """``ssm`` (float32 state), ``ssm-bfloat16``, ``ssm-float16`` or ``ssm-model`` (the model's dtype)."""
    return _NAMES.get(text)


def create(kind: SSM, specs) -> list[SSMCache]:
    """One cache per recurrent layer; fused decode kernels where MLX's default device is a GPU."""
    from butter_ssm.kernels import ops_for

    return [SSMCache(spec, kind, ops=ops_for(spec)) for spec in specs]


def kernel_checks():
    """The scheme's GPU kernels with their pure-mx references, for the conformance suite."""
    from butter_ssm.kernels import KERNEL_CHECKS

    return KERNEL_CHECKS


@hookimpl
def butter_register_cache_schemes(register):
    register(
        CacheScheme(
            name=SSM.scheme,
            kind_type=SSM,
            parse=parse,
            create=create,
            examples=tuple(_NAMES),
            description="recurrent state of Mamba2 / gated delta layers (conv inputs + state), constant in context",
            kernel_checks=kernel_checks,
            layer_types=(MAMBA2, GATED_DELTA),
        )
    )


__all__ = ["SSM", "SSMCache", "butter_register_cache_schemes", "parse"]
