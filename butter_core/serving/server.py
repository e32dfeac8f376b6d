"""Sizing a server's caches from a memory budget, and running the API under uvicorn.

The ASGI stack is Starlette (routing, JSON, server-sent events through ``StreamingResponse``,
which cancels a stream whose client disconnected) under uvicorn (HTTP/1.1, keep-alive): two
small pure-Python libraries, where FastAPI would add pydantic for validation the API does by
hand in a few lines, and ``http.server`` has no streaming cancellation or concurrency of its own.
"""

from __future__ import annotations

import os
import signal
import sys

import uvicorn

from butter_core.batched import PAGE_SIZE
from butter_core.distributed import world
from butter_core.errors import ConfigError
from butter_core.kernels.backend import default_device_is_gpu, gpu_memory
from butter_core.model import Model
from butter_core.serving.openai_api import make_app
from butter_core.serving.scheduler import Scheduler
from butter_core.warm_up import warm_up_batched

KV_MEMORY_FRACTION = 0.25
"""Of the device's memory, what the caches take when ``kv_memory`` is not given."""
PREFIX_CACHE_FRACTION = 0.25
"""Of the caches' bytes (``kv_memory``), what the prefix cache keeps when ``prefix_cache_bytes`` is not given."""


def device_memory() -> int:
    """Bytes of memory the default device has: MLX's figure for a GPU, the machine's RAM otherwise."""
    memory = gpu_memory() if default_device_is_gpu() else None
    return memory or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def capacity_for(model: Model, kv_memory: int, max_sessions: int) -> int:
    """Positions of the batched caches that ``kv_memory`` bytes hold for ``model``'s scheme (pages
    and per-sequence state included), at most what ``max_sessions`` sequences of the model's whole
    context could use."""
    probe = model.engine.make_batched_caches(PAGE_SIZE, max_sequences=max_sessions)
    per_position = probe.bytes_per_position
    fixed = probe.state_bytes + probe.sequence_state_bytes
    if kv_memory < fixed + PAGE_SIZE * per_position:
        raise ConfigError(f"--kv-memory {kv_memory} bytes does not hold one page of {PAGE_SIZE} positions "
                          f"({int(PAGE_SIZE * per_position)} bytes) beside {fixed} bytes of per-sequence state")  # fmt: skip
    positions = min((kv_memory - fixed) // per_position, max_sessions * model.engine.max_context)
    return int(positions // PAGE_SIZE * PAGE_SIZE)  # whole pages, within the budget


def serve(model: Model, *, host: str, port: int, kv_memory: int | None, max_sessions: int, max_queue: int,
          default_max_tokens: int, model_id: str, prefix_cache_bytes: int | None = None,
          warm_up: bool = True) -> None:  # fmt: skip
    """Serve ``model`` until interrupted (``prefix_cache_bytes`` 0: no prefix cache; None: the default),
    after compiling the batched kernels (``warm_up_batched``) unless ``warm_up`` is False. Under tensor
    parallelism rank 0 serves and the other ranks follow its scheduler until it stops."""
    kv_memory = kv_memory or int(device_memory() * KV_MEMORY_FRACTION)
    capacity = capacity_for(model, kv_memory, max_sessions)
    if warm_up:
        seconds = warm_up_batched(model.engine)
        if world().rank() == 0:
            print(f"butter serve: warmed up in {seconds:.2f} s", file=sys.stderr)
    if prefix_cache_bytes is None:
        prefix_cache_bytes = int(kv_memory * PREFIX_CACHE_FRACTION)
    scheduler = Scheduler(model, capacity_tokens=capacity, max_sessions=max_sessions, max_queue=max_queue,
                          prefix_cache_bytes=prefix_cache_bytes)  # fmt: skip
    if world().rank() != 0:  # tensor parallelism: rank 0 serves HTTP, the others step with it
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches every rank: rank 0 ends them all
        scheduler.follow()
        return
    scheduler.start()
    try:
        uvicorn.run(make_app(scheduler, model_id, default_max_tokens=default_max_tokens), host=host, port=port,
                    log_level="warning")  # fmt: skip
    finally:
        scheduler.close()
