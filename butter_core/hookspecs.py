"""The hooks a butter plugin implements (pluggy project ``butter``).

Hooks describe and create; they are never called per token. A plugin registers scheme
objects once at load time, and ``make_layer_caches`` asks the scheme for bound
``LayerCache`` objects, so the decode loop calls plain methods (see docs/architecture.md).

Plugins are found through the ``butter.caches`` entry-point group. A plugin loaded from
that group must implement at least one of the registration hooks (``REGISTRATION_HOOKS``).
"""

import pluggy

PROJECT = "butter"
ENTRY_POINT_GROUP = "butter.caches"
REGISTRATION_HOOKS = ("butter_register_cache_schemes", "butter_register_eviction_policies")

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def butter_register_cache_schemes(register):
    """Register the KV cache schemes this plugin provides.

    Called once, when the plugin loads. Call ``register(scheme)`` with a
    ``butter_core.CacheScheme`` for each scheme: its name, the ``CacheKind`` class it
    creates caches for, how CLI strings such as ``affine4`` parse into kinds, how
    to create one ``LayerCache`` per attention layer (append and
    prepare-for-attention are methods of those caches), and its kernel checks.
    Returns nothing.
    """


@hookspec
def butter_register_eviction_policies(register):
    """Register eviction policies that wrap any scheme's caches.

    Called once, when the plugin loads. Call ``register(policy)`` with a
    ``butter_core.EvictionPolicy``: its name, its configuration class (such as
    ``Window``) and a ``wrap(config, create_inner, specs)`` function returning one
    ``LayerCache`` per spec. Core registers ``window`` this way. Returns nothing.
    """
