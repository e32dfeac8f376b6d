"""butter-example-scheme: the ``fp8`` KV cache scheme, written as a third party writes one.

Nothing in butter-core was edited to add it: the entry point in ``pyproject.toml``
names this module, and butter calls ``butter_register_cache_schemes`` once when the
plugin loads.
"""

from butter_core.plugin_api import CacheScheme, hookimpl
from butter_example_scheme.cache import FP8Cache
from butter_example_scheme.kernels import KERNEL_CHECKS
from butter_example_scheme.kind import FP8, NAMES, parse

__all__ = ["FP8", "FP8Cache", "butter_register_cache_schemes"]


def create(kind: FP8, specs) -> list[FP8Cache]:
    """One cache per attention layer."""
    return [FP8Cache(spec, kind) for spec in specs]


def kernel_checks():
    """The scheme's GPU kernels with their pure-mx references, for the conformance suite."""
    return KERNEL_CHECKS


@hookimpl
def butter_register_cache_schemes(register):
    register(
        CacheScheme(
            name=FP8.scheme,
            kind_type=FP8,
            parse=parse,
            create=create,
            examples=tuple(NAMES),
            description="fp8 E4M3 K/V with one absmax scale per vector (example third-party scheme)",
            kernel_checks=kernel_checks,
        )
    )
