"""Diagnosis (issue 32): why butter raw's decode step waits longer than ``mx.fast.sdpa`` over a
contiguous array, at 32k on a GPU.

28 layers; wall µs per layer (build included) and the allocator's peak over the active
memory per step (a step that copies a buffer shows its size), for SDPA over live slices of
separate buffers and of views of a ``[2, ...]`` stack (as ``SlotBuffers`` keeps raw's keys and
values), with and without slice-assigned appends, and butter raw's own cache, reserved as a
generation reserves it and grown by appends as ``decode_step.py`` fills it.

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
scale = D**-0.5
q = mx.random.normal((1, Q, 1, D)).astype(mx.bfloat16); t = mx.random.normal((1, H, 1, D)).astype(mx.bfloat16)
mx.eval(q, t)

def timed(name, step):
    walls, peaks = [], []
    for n in range(3 + STEPS):
        mx.synchronize(); mx.reset_peak_memory(); base = mx.get_active_memory()
        s = time.perf_counter(); outs = step(n); mx.eval(outs); w = time.perf_counter() - s
        if n >= 3:
            walls.append(w); peaks.append((mx.get_peak_memory() - base) / 2**20)
    print(f"{name:<52} {1e6 * statistics.median(walls) / L:8.1f} us/layer  peak over active {statistics.median(peaks):8.1f} MiB", flush=True)

def fresh(shape):
    return mx.random.normal(shape).astype(mx.bfloat16)

# 1. SDPA over live slices of separate buffers (mlx-lm's layout), no append
ks = [fresh((1, H, ALLOC, D)) for _ in range(L)]; vs = [k * 0.5 for k in ks]; mx.eval(ks, vs)
timed("sdpa, slices of separate buffers", lambda n: [mx.fast.scaled_dot_product_attention(q, k[:, :, :CTX], v[:, :, :CTX], scale=scale) for k, v in zip(ks, vs)])
# 2. the same with slice-assigned appends (mlx-lm KVCache's step)
def sep_step(n):
    outs = []
    for i in range(L):
        ks[i][:, :, CTX + n : CTX + n + 1] = t; vs[i][:, :, CTX + n : CTX + n + 1] = t
        outs.append(mx.fast.scaled_dot_product_attention(q, ks[i][:, :, : CTX + n + 1], vs[i][:, :, : CTX + n + 1], scale=scale))
    return outs
timed("append + sdpa, separate buffers", sep_step)
del ks, vs; mx.clear_cache()
# 3. stacked [2, ...] buffers, views by split + squeeze, no append
st = [mx.stack([fresh((1, H, ALLOC, D))] * 2) for _ in range(L)]; mx.eval(st)
def views(s):
    k, v = mx.split(s, 2); return k.squeeze(0), v.squeeze(0)
timed("sdpa, slices of split views of a [2,...] stack", lambda n: [mx.fast.scaled_dot_product_attention(q, *(x[:, :, :CTX] for x in views(s)), scale=scale) for s in st])
timed("sdpa, slices of s[0], s[1] of the stack", lambda n: [mx.fast.scaled_dot_product_attention(q, s[0][:, :, :CTX], s[1][:, :, :CTX], scale=scale) for s in st])
# 4. stacked with one slice-assigned append of [2, ...]
row = mx.stack([t, t])
def st_step(n):
    outs = []
    for i in range(L):
        st[i][:, :, :, CTX + n : CTX + n + 1] = row
        k, v = views(st[i])
        outs.append(mx.fast.scaled_dot_product_attention(q, k[:, :, : CTX + n + 1], v[:, :, : CTX + n + 1], scale=scale))
    return outs
timed("append + sdpa, [2,...] stack", st_step)
del st; mx.clear_cache()
# 5. butter raw, reserved like a generation, and filled by append like decode_step.py
for how in ("reserve", "append-grown"):
    spec = LayerSpec(H, D, ALLOC, mx.bfloat16)
    caches = make_layer_caches(parse_kv_cache("raw"), [spec] * L)
    if how == "reserve":
        for c in caches: c.reserve(CTX + 3 + STEPS)
    for start in range(0, CTX, 8192):
        k = fresh((1, H, min(8192, CTX - start), D))
        for c in caches: c.append(k, k * 0.5)
        mx.eval([c.state() for c in caches])
    timed(f"butter raw ({how})", lambda n: [c.update_and_attend(q, t, t, scale=scale) for c in caches])
    del caches; mx.clear_cache()
