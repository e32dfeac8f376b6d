"""SlotBuffers: stacked buffers hold what separate ones would, written per stack or per buffer."""

import gc

import attrs
import mlx.core as mx
import pytest

from butter_core import ConfigError, LayerSpec, LoadOptions, Window
from butter_core.model import Model
from butter_core.slots import GROWTH_STEP, SlotBuffers, slot_update
from butter_core.testing.tiny_models import TinySpec

SPEC = LayerSpec(n_kv_heads=2, head_dim=8, max_positions=600)
LAYOUT = {"a": (4, mx.uint32), "b": (4, mx.uint32), "c": (2, mx.float16), "d": (2, mx.float16), "e": (3, mx.float16)}
STACKS = {"ab": ("a", "b"), "cd": ("c", "d")}


def rows(tokens: int, seed: int) -> dict[str, mx.array]:
    return {name: (mx.random.uniform(shape=(1, 2, tokens, width), key=mx.random.key(10 * seed + i)) * 100).astype(dtype)
            for i, (name, (width, dtype)) in enumerate(LAYOUT.items())}


def stacked(named: dict[str, mx.array]) -> dict[str, mx.array]:
    out = {stack: mx.stack([named[m] for m in members]) for stack, members in STACKS.items()}
    return {**out, "e": named["e"]}


def assert_same(x: SlotBuffers, y: SlotBuffers, length: int) -> None:
    for view in ("arrays", "read"):
        ours = x.read() if view == "arrays" else x.read(length)
        theirs = y.read() if view == "arrays" else y.read(length)
        assert sorted(ours) == sorted(LAYOUT)
        for name in LAYOUT:
            assert ours[name].shape == theirs[name].shape, (view, name)
            assert mx.array_equal(ours[name], theirs[name]).item(), (view, name)


@pytest.mark.parametrize("per_stack", [True, False], ids=["rows-per-stack", "rows-per-buffer"])
def test_stacks_hold_what_separate_buffers_hold(per_stack):
    """Writes that grow the buffers (past one 256-slot step) and overwrite live slots read back
    the same, buffer by buffer, as an unstacked layout's."""
    plain = SlotBuffers(SPEC, SPEC.max_positions, LAYOUT)
    stack = SlotBuffers(SPEC, SPEC.max_positions, LAYOUT, stacks=STACKS)
    length = 0
    for seed, (start, tokens) in enumerate([(0, 200), (200, 100), (300, 1), (150, 20), (301, 5)]):
        new = rows(tokens, seed)
        plain.write(start, new, live=length)
        stack.write(start, stacked(new) if per_stack else new, live=length)
        length = max(length, start + tokens)
        mx.eval(list(plain.read(stacked=True).values()), list(stack.read(stacked=True).values()))
        assert_same(stack, plain, length)
    assert stack.allocated == plain.allocated == 512
    assert len(list(stack.read(stacked=True).values())) == 3 and len(list(plain.read(stacked=True).values())) == 5
    assert sum(a.nbytes for a in list(stack.read(stacked=True).values())) == sum(a.nbytes for a in list(plain.read(stacked=True).values()))


def test_stacked_buffers_are_views():
    """Taking a stacked buffer costs no copy of its stack (``stack[i]`` would gather one)."""
    spec = LayerSpec(n_kv_heads=8, head_dim=128, max_positions=1 << 16)
    layout = {"a": (32, mx.uint32), "b": (32, mx.uint32)}
    buffers = SlotBuffers(spec, spec.max_positions, layout, stacks={"ab": ("a", "b")})
    buffers.write(0, {"ab": mx.ones((2, 1, 8, 1 << 16, 32), mx.uint32)}, live=0)
    mx.eval(list(buffers.read(stacked=True).values()))
    gc.collect()
    stack_bytes = list(buffers.read(stacked=True).values())[0].nbytes
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    views = [*buffers.read().values(), *buffers.read(1000).values()]
    mx.eval(views)
    assert mx.get_peak_memory() - before < stack_bytes // 100


def test_views_are_kept_until_a_write_and_do_not_stop_it_writing_in_place():
    """``read()`` hands out the same views until the storage changes (a decode step that writes
    nothing builds no split again); a write drops them first, so it still updates the stack in
    place, and the next ``read()`` shows what it wrote."""
    spec = LayerSpec(n_kv_heads=8, head_dim=128, max_positions=1 << 16)
    layout = {"a": (32, mx.uint32), "b": (32, mx.uint32)}
    buffers = SlotBuffers(spec, spec.max_positions, layout, stacks={"ab": ("a", "b")})
    buffers.write(0, {"ab": mx.ones((2, 1, 8, 1 << 16, 32), mx.uint32)}, live=0)
    first = buffers.read()
    mx.eval(list(first.values()))
    assert all(buffers.read()[name] is first[name] for name in layout)
    stack_bytes = list(buffers.read(stacked=True).values())[0].nbytes
    del first
    gc.collect()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    buffers.write(5, {"ab": mx.full((2, 1, 8, 1, 32), 7, mx.uint32)}, live=1 << 16)
    after = buffers.read()
    mx.eval(list(after.values()))
    assert mx.get_peak_memory() - before < stack_bytes // 100
    assert after["a"][0, 0, 5, 0].item() == 7 and after["b"][0, 0, 4, 0].item() == 1


def test_a_traced_write_replaces_the_storage_in_place():
    """A scheme's ``step_call`` writes its token inside a compiled function (``slot_update``, at a
    slot read from an array) and hands the outputs to ``replace``: the storage is updated in
    place (the old arrays donated to the write), the next ``read`` shows the token, and storage
    of other keys is refused by name."""
    spec = LayerSpec(n_kv_heads=8, head_dim=128, max_positions=1 << 16)
    buffers = SlotBuffers(spec, spec.max_positions, {"a": (32, mx.uint32), "b": (32, mx.uint32)},
                          stacks={"ab": ("a", "b")})  # fmt: skip
    buffers.write(0, {"ab": mx.ones((2, 1, 8, 1 << 16, 32), mx.uint32)}, live=0)
    stack_bytes = buffers.read(stacked=True)["ab"].nbytes
    write = mx.compile(lambda stack, row, slot: slot_update(stack, row, slot, axis=3))
    mx.eval(buffers.read(stacked=True))
    gc.collect()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    for slot in (5, 6):
        buffers.replace({"ab": write(buffers.read(stacked=True)["ab"], mx.full((2, 1, 8, 1, 32), 7, mx.uint32),
                                     mx.array([slot], mx.int32))})  # fmt: skip
        mx.eval(buffers.read(stacked=True))
    assert mx.get_peak_memory() - before < stack_bytes // 100
    after = buffers.read()
    assert [after["a"][0, 0, s, 0].item() for s in (4, 5, 6, 7)] == [1, 7, 7, 1]
    assert after["b"][0, 3, 6, 31].item() == 7
    with pytest.raises(ConfigError, match=r"must hold \['ab'\]; got \['a', 'b'\]"):
        buffers.replace(buffers.read())


@pytest.mark.parametrize("stacks", [{}, {"ab": ("a", "b")}], ids=["by-buffer", "stacked"])
@pytest.mark.parametrize("tokens", [1, 3], ids=["a-token-each", "a-chunk-each"])
def test_write_at_scatters_each_row_to_its_slot_in_place(tokens, stacks):
    """Paged storage's write: row ``(b, t)`` of the step to slot ``slots[b * tokens + t]`` (with
    ``take``, only those rows), rows given as the storage keeps them or by buffer, into storage kept
    by buffer or in a stack, every other slot untouched, and the storage updated in place (no copy of it at any point)."""
    spec = LayerSpec(n_kv_heads=8, head_dim=128, max_positions=1 << 16)
    layout = {"a": (32, mx.uint32), "b": (32, mx.uint32)}
    buffers = SlotBuffers(spec, spec.max_positions, layout, stacks=stacks)
    buffers.reserve(spec.max_positions, live=0)
    mx.eval(list(buffers.read().values()))
    storage_bytes = sum(v.nbytes for v in buffers.read().values())
    batch = 3
    new = mx.arange(2 * batch * 8 * tokens * 32, dtype=mx.uint32).reshape(2, batch, 8, tokens, 32) + 1
    slots = [(7919 * i) % (1 << 16) for i in range(1, batch * tokens + 1)]
    gc.collect()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    buffers.write_at(mx.array(slots, dtype=mx.int32), {"ab": new} if stacks else {"a": new[0], "b": new[1]})
    stored = buffers.read()
    mx.eval(list(stored.values()))
    assert mx.get_peak_memory() - before < storage_bytes // 100
    for m, name in enumerate(("a", "b")):
        flat = new[m].transpose(1, 0, 2, 3).reshape(8, batch * tokens, 32)
        assert mx.array_equal(stored[name][0][:, mx.array(slots)], flat).item()
        assert stored[name].sum().item() == flat.sum().item()  # nothing written elsewhere
    taken = [1, batch * tokens - 1]
    buffers.write_at(mx.array([5, 6], dtype=mx.int32), {"a": new[0] * 0 + 9, "b": new[1]}, take=mx.array(taken))
    flat = new[1].transpose(1, 0, 2, 3).reshape(8, batch * tokens, 32)
    assert mx.array_equal(buffers.read()["b"][0][:, mx.array([5, 6])], flat[:, mx.array(taken)]).item()
    assert (buffers.read()["a"][0][:, mx.array([5, 6])] == 9).all().item()


@pytest.mark.parametrize(
    ("stacks", "message"),
    [
        ({"ab": ("a", "c")}, "different widths or dtypes"),
        ({"ab": ("a", "z")}, "must name buffers"),
        ({"a": ("a", "b")}, "not be one itself"),
        ({"ab": ("a", "b"), "ba": ("b",)}, "in two stacks"),
    ],
)
def test_bad_stacks_are_refused(stacks, message):
    with pytest.raises(ConfigError, match=message):
        SlotBuffers(SPEC, SPEC.max_positions, LAYOUT, stacks=stacks)


@pytest.mark.parametrize("keys", [("ab", "a", "cd", "e"), ("ab", "cd"), ("a", "b", "cd", "e", "zz")])
def test_rows_must_cover_each_buffer_once(keys):
    named = rows(1, 0)
    given = {**named, **stacked(named)}
    buffers = SlotBuffers(SPEC, SPEC.max_positions, LAYOUT, stacks=STACKS)
    with pytest.raises(ConfigError, match="each of"):
        buffers.write(0, {k: given.get(k, named["a"]) for k in keys}, live=0)


def test_growth_is_geometric_and_keeps_what_was_written():
    """Appending a long prompt chunk by chunk reallocates O(log n) times, not once per 256
    slots (which copied O(n**2) rows in all: 93x the writes at 32k positions)."""
    spec = LayerSpec(n_kv_heads=1, head_dim=8, max_positions=40_000)
    buffers = SlotBuffers(spec, spec.max_positions, {"k": (2, mx.float32)})
    sizes = []
    for start in range(0, 32_768, 512):
        buffers.write(start, {"k": mx.full((1, 1, 512, 2), start, mx.float32)}, live=start)
        if buffers.allocated not in sizes:
            sizes.append(buffers.allocated)
    assert len(sizes) <= 20 and sizes[0] == 512 and all(b >= 1.25 * a for a, b in zip(sizes, sizes[1:]))
    assert all(size % GROWTH_STEP == 0 for size in sizes) and sizes[-1] <= 1.25 * 32_768 + GROWTH_STEP
    held = buffers.read(32_768)["k"][0, 0, ::512, 0]
    assert held.tolist() == list(range(0, 32_768, 512))


def test_growth_stops_at_the_capacity_in_whole_steps():
    """Whole steps past the capacity, so MLX's CUDA SDPA may decode over the buffer with cuDNN;
    a capacity below one step is allocated as it is."""
    spec = LayerSpec(n_kv_heads=1, head_dim=8, max_positions=1000)
    buffers = SlotBuffers(spec, spec.max_positions, {"k": (2, mx.float32)})
    for start in range(0, 1000, 100):
        buffers.write(start, {"k": mx.ones((1, 1, 100, 2))}, live=start)
    assert buffers.allocated == 1024
    small = SlotBuffers(attrs.evolve(spec, max_positions=100), 100, {"k": (2, mx.float32)})
    small.reserve(40, live=0)
    assert small.allocated == 100


@pytest.mark.usefixtures("raw_scheme")
def test_a_first_reserve_allocates_once_what_was_asked(tiny_model):
    model = Model.load(str(tiny_model(TinySpec())), LoadOptions(max_context_length=500))
    caches = model.engine.make_layer_caches()
    generation = model.generate(list(range(300)), caches, max_tokens=20, stop_ids=())
    assert [cache.slots.allocated for cache in caches] == [512, 512]  # 320 rounded up to a step, at most 500 in whole steps
    for _ in generation:
        assert [cache.slots.allocated for cache in caches] == [512, 512]  # never grown while generating
    windowed = Model.load(str(tiny_model(TinySpec())), LoadOptions(kv_eviction=Window(64, keep=4)))
    caches = windowed.engine.make_layer_caches()
    windowed.generate(list(range(300)), caches, max_tokens=20)
    assert [cache.inner.slots.allocated for cache in caches] == [64, 64]
