"""`Kernel`: one dialect body, built lazily as an MLX Metal or CUDA custom kernel."""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import mlx.core as mx

from butter_core.kernels import cuda_binaries
from butter_core.kernels.backend import _STANDING_IN, Backend, gpu_backend, tensor_core_shortfall
from butter_core.kernels.dialect import kernel_header, kernel_source

TemplateArg = tuple[str, "bool | int | mx.Dtype"]

_POISON = contextvars.ContextVar("butter_poison_outputs", default=False)
_EXECUTOR: contextvars.ContextVar[Executor | None] = contextvars.ContextVar("butter_kernel_executor", default=None)

# MLX caches compiled CUDA kernels by name (and template values) for the whole
# process, so two different sources under one name would silently share a binary.
_DEFINED: dict[str, tuple[str, str, bool]] = {}

BUILD_KEY = "BT_BUILD"
"""The template value ``Kernel`` adds to every call it makes through ``mx.fast.cuda_kernel``
(where ``cuda_binaries`` is not available): MLX names the function it compiles by the
kernel's name and template values only, so a call at new input dtypes, or a changed
source under an old name, could otherwise meet a binary built for another."""


def build_key(source: str, input_dtypes: Sequence[mx.Dtype], output_dtypes: Sequence[mx.Dtype]) -> int:
    """``BUILD_KEY``'s value: 28 bits of a digest of the full source (header and body) and
    the dtypes of every input and output, the parts of a build MLX's key leaves out."""
    signature = "\n".join([source, *map(str, input_dtypes), "->", *map(str, output_dtypes)])
    return int(hashlib.sha256(signature.encode()).hexdigest()[:7], 16)


class KernelUnavailableError(RuntimeError):
    """Raised when a kernel is called where it cannot run (no GPU backend, or a
    feature the backend's MLX custom kernels lack)."""


@contextlib.contextmanager
def poisoned_outputs() -> Iterator[None]:
    """Within this block, kernel outputs start as NaN instead of whatever memory held,
    so a kernel that leaves part of an output unwritten is caught by a comparison.
    Calls that pass their own ``init_value`` keep it."""
    token = _POISON.set(True)
    try:
        yield
    finally:
        _POISON.reset(token)


@attrs.frozen
class Build:
    """What one call of a kernel has MLX compile: the kernel, the backend, the template
    values and the inputs' dtypes and shapes (on Metal an input of fewer than 8 elements
    is passed in the ``constant`` address space, so its size shapes the source)."""

    kernel: Kernel
    backend: Backend
    template: tuple[TemplateArg, ...]
    input_dtypes: tuple[mx.Dtype, ...]
    input_shapes: tuple[tuple[int, ...], ...]
    output_dtypes: tuple[mx.Dtype, ...]


@attrs.frozen
class Launch:
    """One kernel call as MLX would run it: what it compiles, its inputs, the outputs'
    shapes, the grid (threads), the threadgroup and the outputs' initial value (None:
    uninitialised)."""

    build: Build
    inputs: tuple[mx.array, ...]
    output_shapes: tuple[tuple[int, ...], ...]
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    init_value: float | None


Executor = Callable[[Launch], list[mx.array]]


@contextlib.contextmanager
def executed_by(backend: Backend, execute: Executor) -> Iterator[None]:
    """Within this block ``gpu_backend()`` answers ``backend``, so the code around kernels
    takes that backend's paths, and every kernel call is handed to ``execute`` as a
    ``Launch`` instead of MLX (a kernel the backend cannot build still raises
    ``KernelUnavailableError``). For running or checking a backend's builds on a machine
    without it: ``recorded_builds``, ``butter_core.kernels.metal_emulator``."""
    backend_token = _STANDING_IN.set(backend)
    executor_token = _EXECUTOR.set(execute)
    try:
        yield
    finally:
        _EXECUTOR.reset(executor_token)
        _STANDING_IN.reset(backend_token)


@contextlib.contextmanager
def recorded_builds(backend: Backend) -> Iterator[list[Build]]:
    """``executed_by(backend, ...)`` where kernel calls run nothing: each appends its
    ``Build`` to the list yielded and returns zero-filled outputs, so the code around a
    kernel goes on as it would there (``butter_core.kernels.metal_check``)."""
    builds: list[Build] = []

    def record(launch: Launch) -> list[mx.array]:
        builds.append(launch.build)
        return [mx.zeros(shape, dtype) for shape, dtype in zip(launch.output_shapes, launch.build.output_dtypes)]

    with executed_by(backend, record):
        yield builds


class Kernel:
    """A custom GPU kernel whose body is written once in the butter dialect.

    ``body`` is the inside of the kernel function (see ``butter_core.kernels.dialect``
    for the vocabulary and for the signature MLX generates from ``input_names`` and
    ``output_names``); ``helpers`` is extra header code (device functions, written with
    ``BT_FUNC``). ``shared_memory`` is bytes of dynamic shared memory, which only MLX's
    CUDA kernels support. ``mma`` adds the dialect's tensor-core vocabulary to the header
    (``bt_mma_16x8x16`` and friends). Nothing is compiled until the first call. MLX compiles
    once per process and distinct ``template`` (on CUDA also per source and dtypes:
    ``BUILD_KEY``); on CUDA, unless ``BUTTER_CUDA_BINARIES=0``, a build (template values, dtypes,
    ranks) is compiled once per install by ``cuda_binaries`` instead.
    """

    def __init__(
        self,
        name: str,
        input_names: Sequence[str],
        output_names: Sequence[str],
        body: str,
        *,
        helpers: str = "",
        shared_memory: int = 0,
        mma: bool = False,
    ) -> None:
        definition = (body, helpers, mma)
        if _DEFINED.setdefault(name, definition) != definition:
            raise ValueError(
                f"kernel name {name!r} is already used by a different kernel; MLX caches "
                "compiled kernels by name, so kernel names must be unique"
            )
        self.name = name
        self.input_names = tuple(input_names)
        self.output_names = tuple(output_names)
        self.body = body
        self.helpers = helpers
        self.shared_memory = shared_memory
        self.mma = mma
        self._built: dict[Backend, Any] = {}
        self._build_keys: dict[tuple[tuple[mx.Dtype, ...], tuple[mx.Dtype, ...]], int] = {}
        self._binaries: dict[tuple, cuda_binaries.Rendered | None] = {}

    def __repr__(self) -> str:
        return f"Kernel({self.name!r}, inputs={self.input_names}, outputs={self.output_names})"

    def source(self, backend: Backend) -> str:
        """The function-body source handed to MLX for ``backend``."""
        return kernel_source(backend, self.body)

    def header(self, backend: Backend) -> str:
        """The header source handed to MLX for ``backend``."""
        return kernel_header(backend, self.helpers, mma=self.mma)

    def unavailable_reason(self) -> str | None:
        """Why this kernel cannot run here, or None when it can."""
        backend = gpu_backend()
        if backend is None:
            return (
                f"kernel {self.name!r} needs a GPU backend (Metal or CUDA); this MLX has "
                "neither — use the kernel's pure-mx reference on the CPU"
            )
        if backend == "metal" and self.shared_memory:
            return (
                f"kernel {self.name!r} asks for dynamic shared memory, which "
                "mx.fast.metal_kernel does not support"
            )
        shortfall = tensor_core_shortfall() if self.mma else None
        if shortfall:
            return f"kernel {self.name!r} cannot run here: {shortfall}"
        return None

    def available(self) -> bool:
        """Whether this kernel can run on this machine."""
        return self.unavailable_reason() is None

    def __call__(
        self,
        *,
        inputs: Sequence[mx.array],
        output_shapes: Sequence[Sequence[int]],
        output_dtypes: Sequence[mx.Dtype],
        grid: tuple[int, int, int],
        threadgroup: tuple[int, int, int],
        template: Sequence[TemplateArg] = (),
        init_value: float | None = None,
        verbose: bool = False,
        executor: bool = True,
    ) -> list[mx.array]:
        """Run on the GPU stream, as MLX's custom kernels run: ``grid`` counts threads
        (not threadgroups) along each axis; outputs are fresh arrays. Within
        ``executed_by`` the executor runs the call instead, unless ``executor`` is False
        (an executor that runs each kernel as another one, as ``bench/gpu_timeline.py``
        adds timestamps, runs that one on MLX this way)."""
        if init_value is None and _POISON.get():
            init_value = float("nan")
        execute = _EXECUTOR.get() if executor else None
        if execute is not None:
            self._check_available()
            build = Build(
                kernel=self,
                backend=gpu_backend(),
                template=tuple(template),
                input_dtypes=tuple(x.dtype for x in inputs),
                input_shapes=tuple(tuple(x.shape) for x in inputs),
                output_dtypes=tuple(output_dtypes),
            )
            return execute(Launch(build, tuple(inputs), tuple(tuple(s) for s in output_shapes), tuple(grid),
                                  tuple(threadgroup), init_value))
        backend = gpu_backend()
        if backend == "cuda" and cuda_binaries.available():
            rendered = self._binary(template, inputs, output_dtypes, verbose)
            if rendered is not None:
                return cuda_binaries.launch(rendered, inputs=inputs, output_shapes=output_shapes,
                                            output_dtypes=output_dtypes, grid=grid, threadgroup=threadgroup,
                                            shared_memory=self.shared_memory, init_value=init_value)
        built = self._built.get(backend)  # checked when it was built
        if built is None:
            built = self._build()
        template = list(template)
        if backend == "cuda":
            template.append((BUILD_KEY, self._build_key(tuple(x.dtype for x in inputs), tuple(output_dtypes))))
        return built(
            inputs=list(inputs),
            output_shapes=[tuple(s) for s in output_shapes],
            output_dtypes=list(output_dtypes),
            grid=grid,
            threadgroup=threadgroup,
            template=template,
            init_value=init_value,
            verbose=verbose,
            stream=mx.gpu,
        )

    def _binary(self, template: Sequence[TemplateArg], inputs: Sequence[mx.array],
                output_dtypes: Sequence[mx.Dtype], verbose: bool) -> cuda_binaries.Rendered | None:
        """This call's build compiled by ``cuda_binaries`` and placed where MLX loads it, or None
        where it cannot be (the kernel reads strides, NVRTC rejects the stand-alone source, or a
        directory cannot be written: warned once, and the kernel runs through
        ``mx.fast.cuda_kernel``)."""
        key = (tuple(template), tuple(x.dtype for x in inputs), tuple(x.ndim for x in inputs), tuple(output_dtypes))
        if key in self._binaries:
            rendered = self._binaries[key]
        else:
            self._check_available()
            try:
                rendered = cuda_binaries.render(self, *key)
                cuda_binaries.place(rendered)
            except (cuda_binaries.CudaBinaryError, OSError) as error:  # OSError: a directory not writable here
                warnings.warn(f"butter: kernel {self.name!r} compiles through mx.fast.cuda_kernel: {error}",
                              stacklevel=3)
                rendered = None
            self._binaries[key] = rendered
        if verbose and rendered is not None:
            print(rendered.source)
        return rendered

    def _build_key(self, input_dtypes: tuple[mx.Dtype, ...], output_dtypes: tuple[mx.Dtype, ...]) -> int:
        """``build_key`` for this kernel's CUDA source, once per distinct dtypes."""
        key = self._build_keys.get((input_dtypes, output_dtypes))
        if key is None:
            key = build_key(self.header("cuda") + self.source("cuda"), input_dtypes, output_dtypes)
            self._build_keys[(input_dtypes, output_dtypes)] = key
        return key

    def _check_available(self) -> None:
        reason = self.unavailable_reason()
        if reason is not None:
            raise KernelUnavailableError(reason)

    def _build(self) -> Any:
        self._check_available()
        backend = gpu_backend()
        assert backend is not None
        if backend not in self._built:
            common = dict(
                name=self.name,
                input_names=list(self.input_names),
                output_names=list(self.output_names),
                source=self.source(backend),
                header=self.header(backend),
                ensure_row_contiguous=True,
            )
            if backend == "metal":
                self._built[backend] = mx.fast.metal_kernel(**common)
            else:
                self._built[backend] = mx.fast.cuda_kernel(
                    **common, shared_memory=self.shared_memory
                )
        return self._built[backend]
