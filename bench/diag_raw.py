"""Diagnosis (issue 32): why butter raw's decode step waits longer than ``mx.fast.sdpa`` over a
contiguous array, at 32k on a GPU.

28 layers; wall µs per layer (build included) and the allocator's peak over the active
memory per step (a step that copies a buffer shows its size), for SDPA over live slices of
separate buffers and of views of a ``[2, ...]`` stack (as ``SlotBuffers`` keeps raw's keys and
values), with and without slice-assigned appends, and butter raw's own cache, reserved as a
generation reserves it and grown by appends as ``decode_step.py`` fills it. ``ALLOC`` is not
a multiple of 256, so these buffers take MLX's vector SDPA kernel; separate buffers of whole
256-slot steps are timed beside them (MLX takes cuDNN there: docs/benchmarks.md, "The fix").

Usage: python3 bench/diag_raw.py   (results: docs/benchmarks.md, "Issue 32 on an H100")
"""

import statistics
import time

import butter_core  # noqa: F401 - before mlx.core
import mlx.core as mx
from butter_core import parse_kv_cache
from butter_core.cache import LayerSpec
from butter_core.layer_caches import make_layer_caches

L, H, Q, D, CTX, STEPS = 28, 8, 32, 128, 32768, 20
ALLOC = CTX + 64
SCALE = D**-0.5


def timed(name, step) -> None:
    walls, peaks = [], []
    for n in range(3 + STEPS):
        mx.synchronize()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        start = time.perf_counter()
        mx.eval(step(n))
        wall = time.perf_counter() - start
        if n >= 3:
            walls.append(wall)
            peaks.append((mx.get_peak_memory() - base) / 2**20)
    print(f"{name:<52} {1e6 * statistics.median(walls) / L:8.1f} us/layer  "
          f"peak over active {statistics.median(peaks):8.1f} MiB", flush=True)  # fmt: skip


def fresh(shape) -> mx.array:
    return mx.random.normal(shape).astype(mx.bfloat16)


def sdpa(q, k, v):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE)


def separate(q, t, alloc: int | None = None) -> None:
    """mlx-lm's layout: one buffer for keys, one for values, of ``alloc`` slots (default ``ALLOC``)."""
    alloc = alloc or ALLOC
    ks = [fresh((1, H, alloc, D)) for _ in range(L)]
    vs = [k * 0.5 for k in ks]
    mx.eval(ks, vs)
    timed(f"sdpa, slices of separate buffers of {alloc} slots",
          lambda n: [sdpa(q, k[:, :, :CTX], v[:, :, :CTX]) for k, v in zip(ks, vs)])  # fmt: skip

    def step(n):
        outs = []
        for k, v in zip(ks, vs):
            k[:, :, CTX + n : CTX + n + 1] = t
            v[:, :, CTX + n : CTX + n + 1] = t
            outs.append(sdpa(q, k[:, :, : CTX + n + 1], v[:, :, : CTX + n + 1]))
        return outs

    timed("append + sdpa, separate buffers", step)


def stacked(q, t) -> None:
    """``SlotBuffers``' layout for raw: keys and values in one ``[2, ...]`` array."""
    stacks = [mx.stack([fresh((1, H, ALLOC, D))] * 2) for _ in range(L)]
    mx.eval(stacks)

    def views(stack):
        k, v = mx.split(stack, 2)
        return k.squeeze(0), v.squeeze(0)

    timed("sdpa, slices of split views of a [2,...] stack",
          lambda n: [sdpa(q, *(x[:, :, :CTX] for x in views(s))) for s in stacks])  # fmt: skip
    timed("sdpa, slices of s[0], s[1] of the stack", lambda n: [sdpa(q, s[0][:, :, :CTX], s[1][:, :, :CTX]) for s in stacks])
    row = mx.stack([t, t])

    def step(n):
        outs = []
        for stack in stacks:
            stack[:, :, :, CTX + n : CTX + n + 1] = row
            k, v = views(stack)
            outs.append(sdpa(q, k[:, :, : CTX + n + 1], v[:, :, : CTX + n + 1]))
        return outs

    timed("append + sdpa, [2,...] stack", step)


def butter_raw(q, t, how: str) -> None:
    """butter raw's caches, reserved as a generation reserves them, or grown by appends."""
    caches = make_layer_caches(parse_kv_cache("raw"), [LayerSpec(H, D, ALLOC, mx.bfloat16)] * L)
    if how == "reserve":
        for cache in caches:
            cache.reserve(CTX + 3 + STEPS)
    for start in range(0, CTX, 8192):
        k = fresh((1, H, min(8192, CTX - start), D))
        for cache in caches:
            cache.append(k, k * 0.5)
        mx.eval([cache.state() for cache in caches])
    timed(f"butter raw ({how})", lambda n: [cache.update_and_attend(q, t, t, scale=SCALE) for cache in caches])


def main() -> None:
    q, t = fresh((1, Q, 1, D)), fresh((1, H, 1, D))
    mx.eval(q, t)
    for run in (separate, lambda q, t: separate(q, t, -(-ALLOC // 256) * 256), stacked, lambda q, t: butter_raw(q, t, "reserve"), lambda q, t: butter_raw(q, t, "append-grown")):
        run(q, t)
        mx.clear_cache()


if __name__ == "__main__":
    main()
