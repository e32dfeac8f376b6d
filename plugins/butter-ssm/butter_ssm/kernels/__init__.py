"""butter-ssm's GPU kernels: a fused decode step per mixer, with their pure-mx references.

``ops_for(spec)`` is what a cache runs its updates with: None (the mixer's own chunked
reference, ``butter_core.recurrent``) until the kernels land.
"""

from __future__ import annotations

KERNEL_CHECKS: tuple = ()


def ops_for(spec):
    """How a cache of ``spec`` runs its updates here (None: the mixer's reference)."""
    return None
