"""`KernelCheck`: how a scheme declares that a kernel matches its pure-mx reference.

Every scheme lists one ``KernelCheck`` per kernel it ships; the conformance suite and
the GPU bench scripts iterate those lists, build inputs, run kernel and reference on the
same inputs (with poisoned kernel outputs) and compare.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
import mlx.core as mx
import numpy as np

from butter_core.kernels.backend import BACKENDS, Backend, tensor_cores_available
from butter_core.kernels.kernel import Build, poisoned_outputs, recorded_builds

Inputs = dict[str, Any]

DEFAULT_RTOL: Mapping[mx.Dtype, float] = {
    mx.float32: 1e-5,
    mx.float16: 2e-3,
    mx.bfloat16: 1e-2,
}
"""Bound on ``relative_error`` by output dtype: a few roundings to that dtype."""


def relative_error(out: mx.array, ref: mx.array) -> float:
    """‖out − ref‖ / ‖ref‖ in float32 (NaN anywhere in ``out`` gives NaN)."""
    out32 = out.astype(mx.float32)
    ref32 = ref.astype(mx.float32)
    num = mx.linalg.norm((out32 - ref32).reshape(-1))
    den = mx.maximum(mx.linalg.norm(ref32.reshape(-1)), mx.array(1e-30))
    return (num / den).item()


@attrs.frozen
class CheckResult:
    """The outcome of one kernel-versus-reference comparison."""

    name: str
    sizes: Mapping[str, Any]
    relative_error: float
    tolerance: float

    @property
    def passed(self) -> bool:
        # NaN compares false, so unwritten (poisoned) outputs fail.
        return self.relative_error <= self.tolerance


@attrs.frozen
class KernelCheck:
    """A kernel, its reference, and how to make inputs for both.

    ``kernel`` and ``reference`` take the same keyword arguments, which
    ``make_inputs(seed, **sizes)`` returns as a dict; ``cases`` are the size sets a
    conformance run covers (each may hold a ``dtype``). ``rtol`` bounds the relative
    error per output dtype. ``backends`` are those the kernel is built for (e.g. only
    ``{"cuda"}`` for a kernel that needs dynamic shared memory); elsewhere its check is
    skipped. ``tensor_cores``: the kernel uses the dialect's tensor-core vocabulary
    (``Kernel(..., mma=True)``), so its check is skipped where that cannot run (CUDA
    devices older than compute capability 8.0: ``tensor_cores_available``). ``kernel_options``:
    sizes that reach the kernel as keyword arguments as they are (a forced split count, say),
    and reach neither ``make_inputs`` nor the reference (``inputs``).
    """

    name: str
    kernel: Callable[..., mx.array]
    reference: Callable[..., mx.array]
    make_inputs: Callable[..., Inputs]
    cases: tuple[Mapping[str, Any], ...]
    rtol: Mapping[mx.Dtype, float] = DEFAULT_RTOL
    backends: frozenset[Backend] = BACKENDS
    tensor_cores: bool = False
    kernel_options: tuple[str, ...] = ()

    def inputs(self, seed: int = 0, **sizes: Any) -> Inputs:
        """The kernel's keyword arguments for these sizes: ``make_inputs(seed, **sizes)`` of the
        sizes that are not ``kernel_options``, plus those that are."""
        options = {name: sizes.pop(name) for name in self.kernel_options if name in sizes}
        return self.make_inputs(seed, **sizes) | options

    def runs_on(self, backend: Backend) -> bool:
        """Whether this check's kernel can run on ``backend``, this machine's GPU backend."""
        return backend in self.backends and (not self.tensor_cores or tensor_cores_available())

    def run_kernel(self, inputs: Inputs) -> mx.array:
        """The kernel's output for ``inputs``, evaluated, with poisoned outputs."""
        with poisoned_outputs():
            out = self.kernel(**inputs)
            mx.eval(out)
        return out

    def run_reference(self, inputs: Inputs) -> mx.array:
        """The reference's output for ``inputs``, evaluated on the CPU, where float32
        matmuls are true float32 (MLX's CUDA matmuls default to TF32, whose ~1e-3
        relative error would swamp a float32 kernel's)."""
        with mx.stream(mx.cpu):
            out = self.reference(**{name: value for name, value in inputs.items() if name not in self.kernel_options})
            mx.eval(out)
        return out

    def check(self, seed: int = 0, **sizes: Any) -> CheckResult:
        """Compare kernel and reference on fresh random inputs of the given sizes."""
        inputs = self.inputs(seed, **sizes)
        ref = self.run_reference(inputs)
        out = self.run_kernel(inputs)
        return CheckResult(
            name=self.name,
            sizes=dict(sizes),
            relative_error=relative_error(out, ref),
            tolerance=self.rtol[ref.dtype],
        )


def recorded_check_builds(checks: Iterable[KernelCheck], backend: Backend) -> list[Build]:
    """Every build the cases of ``checks`` built for ``backend`` make, in order, repeats
    included: each case's inputs made and its kernel called under ``recorded_builds(backend)``
    (nothing runs). A kernel a case calls that cannot be built there raises, as it would there."""
    builds: list[Build] = []
    for check in checks:
        if backend not in check.backends:
            continue
        for case in check.cases:
            with recorded_builds(backend) as recorded:
                check.kernel(**check.inputs(0, **case))
            builds += recorded
    return builds


def scattered_pages(rng: np.random.Generator, lengths: Sequence[int], page_size: int) -> tuple[np.ndarray, list[np.ndarray], int]:
    """A random paged layout for sequences of ``lengths`` positions (``butter_core.batched``), as a
    paged kernel's check wants it: each sequence's pages drawn in a shuffled order from storage with
    about as many free pages as used ones, its table padded with its first page. Returns the table
    ``[B, pages]`` (int32), each sequence's live slots in position order, and the storage's slots."""
    pages = [-(-n // page_size) for n in lengths]
    total_pages = 2 * sum(pages) + 1
    order = rng.permutation(total_pages)
    table = np.zeros((len(lengths), max(pages)), dtype=np.int32)
    taken, live = 0, []
    for b, (count, n) in enumerate(zip(pages, lengths)):
        table[b, :count] = order[taken : taken + count]
        table[b, count:] = table[b, 0]
        taken += count
        positions = np.arange(n)
        live.append(table[b, positions // page_size].astype(np.int64) * page_size + positions % page_size)
    return table, live, total_pages * page_size


def attention_inputs(
    seed: int, *, batch: int, q_heads: int, kv_heads: int, head_dim: int, allocated: int, length: int,
    dead: tuple[float, float] = (1e3, 1e3),
) -> dict[str, Any]:
    """Random float32 inputs of a decode kernel's check over one cache's buffers, for a scheme to
    encode: Gaussian keys and values in slots ``[0, length)``, ``dead`` (key, value) in the rest of
    the ``allocated``, so a kernel that reads past the live slots gets a visibly wrong result.
    Returns ``queries`` ``[batch, q_heads, 1, head_dim]`` and ``keys``/``values`` ``[batch, kv_heads,
    allocated, head_dim]`` (numpy), ``length`` and ``scale``; ``paged_attention_inputs`` is the
    same over pages."""
    rng = np.random.default_rng(seed)
    shape = (batch, kv_heads, allocated, head_dim)
    keys, values = (rng.standard_normal(shape, dtype=np.float32) for _ in range(2))
    keys[:, :, length:], values[:, :, length:] = dead
    queries = rng.standard_normal((batch, q_heads, 1, head_dim), dtype=np.float32)
    return {"queries": queries, "keys": keys, "values": values, "length": length, "scale": head_dim**-0.5}


def paged_attention_inputs(
    seed: int, *, lengths: Sequence[int], page_size: int, q_heads: int, kv_heads: int, head_dim: int,
    dead: tuple[float, float] = (1e3, 1e3),
) -> dict[str, Any]:
    """Random float32 inputs of a paged decode kernel's check (``butter_core.batched``), for a scheme to
    encode: pages laid out by ``scattered_pages``; Gaussian keys and values in the live slots, ``dead`` (key, value) in every other slot, so a kernel that reads
    another sequence's slot or a dead one gets a visibly wrong result. Returns ``queries`` ``[B,
    q_heads, 1, head_dim]``, ``keys``/``values`` ``[1, kv_heads, slots, head_dim]`` (numpy), ``table``
    and ``lengths`` (int32 mx arrays), ``page_size``, ``length`` (the longest) and ``scale``."""
    rng = np.random.default_rng(seed)
    table, live, total = scattered_pages(rng, lengths, page_size)
    shape = (1, kv_heads, total, head_dim)
    keys, values = np.full(shape, dead[0], dtype=np.float32), np.full(shape, dead[1], dtype=np.float32)
    for slots in live:
        keys[0][:, slots] = rng.standard_normal((kv_heads, len(slots), head_dim))
        values[0][:, slots] = rng.standard_normal((kv_heads, len(slots), head_dim))
    return {
        "queries": rng.standard_normal((len(lengths), q_heads, 1, head_dim), dtype=np.float32),
        "keys": keys,
        "values": values,
        "table": mx.array(table),
        "lengths": mx.array(np.array(lengths, dtype=np.int32)),
        "page_size": page_size,
        "length": max(lengths),
        "scale": head_dim**-0.5,
    }
