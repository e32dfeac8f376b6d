"""Everything a cache-scheme or eviction plugin builds on, in one module.

A plugin's library code imports from here only (its tests add ``butter_core.testing``);
docs/plugin-authors.md walks through each name. What is listed in ``__all__`` is the
plugin surface: it changes only with a note in that guide, and ``tests/test_plugin_api.py``
keeps every name the guide documents importable.

- The attention contract: ``LayerCache`` (what every layer's cache has),
  ``AttentionCache`` (what a model's attention calls), ``SlotCache`` (what an attention
  scheme subclasses), ``BufferedSlotCache`` and ``SlotBuffers`` (storage grown in steps),
  ``StepCall`` (a decode step as one traced call), ``LayerSpec``, ``check_chunk``, ``attend`` and ``reference_attention``; ``gather_pages`` and
  ``live_mask`` for the references of paged decode kernels and ``SequenceState`` with
  ``Written`` for state a scheme keeps per sequence beside the pages (``butter_core.batched``).
- The recurrent contract: ``StateCache`` (what a recurrent scheme subclasses),
  ``StateSpec``, the mixers ``Mamba2Mixer`` and ``GatedDeltaMixer`` with their layer types,
  and ``recurrent_ops``, the pure-``mx`` scans their kernels are checked against.
- Configuration: ``CacheKind`` and ``Eviction`` to subclass, ``one_of`` and ``positive``
  validators, ``ConfigError`` and the other errors.
- Registration: ``hookimpl``, ``CacheScheme``, ``EvictionPolicy``.
- CPU helpers a scheme's own attention path may share: ``softmax_for``,
  ``grouped_queries``, ``compile_by_shape``.
- The kernel layer (``butter_core.kernels``): ``Kernel``, ``KernelCheck`` (with
  ``attention_inputs``, ``paged_attention_inputs`` and ``scattered_pages``, decode kernels' check inputs),
  ``kernel_params``, ``split_k`` and ``mma``, and what decides where kernels run.
"""

from butter_core import recurrent_ops
from butter_core.batched import gather_pages, live_mask
from butter_core.cache import (
    ATTENTION,
    AttentionCache,
    LayerCache,
    LayerSpec,
    Mask,
    SlotCache,
    Snapshot,
    StepCall,
    attend,
    check_chunk,
    reference_attention,
)
from butter_core.compiled import compile_by_shape
from butter_core.config import CacheKind, Eviction, one_of, positive
from butter_core.cpu_attention import grouped_queries, softmax_for
from butter_core.errors import ButterError, ConfigError, PluginError
from butter_core.hookspecs import hookimpl
from butter_core.kernels import (
    Kernel,
    KernelCheck,
    default_device_is_gpu,
    gpu_backend,
    kernel_params,
    mma,
    attention_inputs,
    paged_attention_inputs,
    scattered_pages,
    split_k,
    tensor_cores_available,
)
from butter_core.kernels.backend import GpuShape, gpu_shape
from butter_core.recurrent import GATED_DELTA, MAMBA2, GatedDeltaMixer, Mamba2Mixer, StateCache, StateSpec
from butter_core.registry import CacheScheme, EvictionPolicy
from butter_core.sequence_state import SequenceState, Written
from butter_core.slots import BufferedSlotCache, KernelBuffers, Layout, SlotBuffers, Stacks, slot_update, unstack
from butter_core.working_set import PrefillPipeline

__all__ = [
    "ATTENTION",
    "AttentionCache",
    "BufferedSlotCache",
    "ButterError",
    "CacheKind",
    "CacheScheme",
    "ConfigError",
    "Eviction",
    "EvictionPolicy",
    "GATED_DELTA",
    "GatedDeltaMixer",
    "GpuShape",
    "Kernel",
    "KernelBuffers",
    "KernelCheck",
    "LayerCache",
    "LayerSpec",
    "Layout",
    "MAMBA2",
    "Mamba2Mixer",
    "Mask",
    "PluginError",
    "PrefillPipeline",
    "SequenceState",
    "SlotBuffers",
    "SlotCache",
    "Snapshot",
    "Stacks",
    "StateCache",
    "StateSpec",
    "StepCall",
    "attend",
    "check_chunk",
    "compile_by_shape",
    "default_device_is_gpu",
    "gpu_backend",
    "gpu_shape",
    "grouped_queries",
    "hookimpl",
    "gather_pages",
    "kernel_params",
    "live_mask",
    "mma",
    "one_of",
    "attention_inputs",
    "paged_attention_inputs",
    "positive",
    "recurrent_ops",
    "reference_attention",
    "scattered_pages",
    "slot_update",
    "softmax_for",
    "split_k",
    "tensor_cores_available",
    "unstack",
    "Written",
]
