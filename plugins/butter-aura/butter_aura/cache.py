"""``AuraCache``: a layer's keys and values as rotated codebook codes, with a small full-precision budget."""

from __future__ import annotations

import mlx.core as mx

from butter_core.plugin_api import BufferedSlotCache, ConfigError, LayerSpec, PrefillPipeline, attend, kernel_params

from butter_aura import reference
from butter_aura.codec import SCALE_DTYPE
from butter_aura.kernels.attention import traces
from butter_aura.kind import Aura
from butter_aura.layout import DEFAULT_SEED, FullPrecisionBudget, codecs, full_precision_dtype, ring_rows, stacks_for
from butter_aura.rotation import Rotation, layer_seed
from butter_aura.sequences import FullPrecisionRows, RecentRings
from butter_aura.stored import StoredLayer

FULL_PRECISION_ARRAYS = ("fp_keys", "fp_values", "recent_slots", "recent_positions")
"""State arrays beside the slot buffers: the full-precision rows, which slots they hold and
the positions those slots held when written (the cache keeps the last two on the host:
``AuraCache._recent``, ``AuraCache._recent_positions``)."""


class AuraCache(BufferedSlotCache):
    """Keys and values rotated per KV head, then coded with Lloyd–Max codebooks.

    Storage per slot and KV head: ``key_codes``/``value_codes`` (uint32, the codec's
    words) and ``key_scales``/``value_scales`` (float16). Beside the slots, the sink
    slots and the slots of the newest positions keep 16-bit copies of their original
    vectors (``FullPrecisionBudget``), which attention reads instead of their codes. Newest
    by absolute position: under window eviction slots are reused, and a window writes a
    chunk that wraps its ring in slot order, so of two positions whose slots share a row
    the newer keeps it, whichever was written last.
    The two scale buffers share one array, as do the two code buffers where keys and
    values have equal bits (``layout.stacks_for``), so an append writes fewer arrays.

    Attention:

    * one query token (decode): ``decode_attention`` straight on the codes (the fused
      kernel on a GPU: no key or value is materialised);
    * a chunk of query tokens (prefill) that was just stored: two-phase — the chunk
      attends to the dequantized earlier slots plus its own keys and values in full
      precision; its codes serve later tokens;
    * anything else (the window decorator's wrap-around path): dequantized slots.

    In batched storage (``butter_core.batched``) the pages hold the codes (``encode``,
    ``decode``) and ``FullPrecisionRows`` each sequence's full-precision rows
    (``sequence_state``); a chunk attends to its own rows as they came there too.

    Re-encoding a slot writes whole new code words, so nothing of a slot's previous
    contents survives (window eviction overwrites slots).

    A multi-token attention's output goes to ``pipeline`` (shared by the layers of one model;
    None: no bound), so that on a GPU few layers' decoded K/V exist at once in a prefill
    (``butter_core.working_set``), as butter-affine's caches do.

    ``ops`` runs encode/decode_attention/dequantize: ``kernels.ops_for(spec)`` picks, when
    the scheme creates caches, ``butter_aura.kernels.GPU_OPS`` on a GPU that serves the
    head size, else ``butter_aura.cpu`` (pure mx, fast on the CPU); ``butter_aura.reference``
    (pure mx, readable, what both are checked against) when none is given. ``seed`` is the
    base seed of the layer's rotation.
    """

    def __init__(self, spec: LayerSpec, kind: Aura, *, seed: int = DEFAULT_SEED, ops=None,
                 pipeline: PrefillPipeline | None = None):
        self.kind = kind
        self.pipeline = pipeline
        self.key_codec, self.value_codec = codecs(kind, spec.head_dim)
        layout = {
            "key_codes": (self.key_codec.words, mx.uint32),
            "key_scales": (self.key_codec.groups, SCALE_DTYPE),
            "value_codes": (self.value_codec.words, mx.uint32),
            "value_scales": (self.value_codec.groups, SCALE_DTYPE),
        }
        super().__init__(spec, layout, stacks=stacks_for(self.key_codec, self.value_codec))
        self.budget = FullPrecisionBudget.for_capacity(self.capacity, spec.ring_start)
        self.fp_dtype = full_precision_dtype(spec.dtype)
        self.rotation = Rotation(layer_seed(seed, spec.layer_index), spec.n_kv_heads, spec.head_dim, spec.shard)
        self.ops = ops or reference
        self._fp = self._empty_full_precision()
        self._recent = [-1] * self.budget.ring
        """Which slot each recent-ring row holds (-1: none), kept on the host only: ``stored`` makes
        the ``recent_slots`` array kernels read from it, so a decode step updates no device
        array for it (one kernel launch fewer per layer than a slice assignment), and the
        CPU path and the kernels' ring bounds read it without a device sync."""
        self._recent_positions = [-1] * self.budget.ring
        """The position each recent-ring row's slot held when written (-1: none): a row goes to
        the newer of two positions."""
        self._unencoded: set[int] = set()
        """Recent-ring slots whose codes are not written yet (``store``); each is in the ring."""
        self._step = None
        """What makes a decode step's call (``step_call``), once made."""

    # -- storage ---------------------------------------------------------------

    def _empty_full_precision(self) -> dict[str, mx.array]:
        s, rows = self.spec, self.budget.rows
        shape = (s.batch_size, s.n_kv_heads, rows, s.head_dim)
        arrays = {"fp_keys": mx.zeros(shape, self.fp_dtype), "fp_values": mx.zeros(shape, self.fp_dtype)}
        # Materialised at once (a few KB): slice assignment into a lazy broadcast of
        # zeros would keep hidden copies alive.
        mx.eval(arrays)
        return arrays

    def encode(self, keys, values):
        return self.ops.encode_rows(keys, values, self.rotation, self.key_codec, self.value_codec)

    def decode(self, rows):
        """The codes' vectors, rotated back (full-precision rows are not in ``rows``: ``load`` and
        ``FullPrecisionRows`` put them in)."""
        keys = self.rotation.invert(self.key_codec.decode(rows["key_codes"], rows["key_scales"]))
        values = self.rotation.invert(self.value_codec.decode(rows["value_codes"], rows["value_scales"]))
        return keys.astype(self.spec.dtype), values.astype(self.spec.dtype)

    def sequence_state(self, sequences, capacity, ring_start, shared):
        key = (RecentRings, sequences, capacity, ring_start)  # the layers under one window share their rings
        if key not in shared:
            shared[key] = RecentRings(FullPrecisionBudget.for_capacity(capacity, ring_start), sequences)
        return FullPrecisionRows(self, shared[key])

    def store(self, start, keys, values, position):
        """Encode and write the rows, and copy those the budget keeps into the full-precision rows.

        A single token bound for the recent ring is not encoded yet: attention reads it
        from its full-precision row until it leaves the ring, so its codes are written
        when some later write needs its row (``_encode_unencoded``: one encode for up to
        ``recent`` tokens), or before anything reads codes (``load``, ``export_slots``).
        A decode step then makes no encode call and no slot write, only the ring's. The
        codes are those of the ring's copy: for 16-bit models the token itself, so those an
        immediate encode would write; for float32 models its float16 copy, the copy attention
        read while the token was in the ring (``_deferred_row``)."""
        index = self._deferred_row(start, keys.shape[2], keys.dtype, position)
        if index is not None:
            self._defer(index, start, position)
            self._copy_to_ring_row(index, keys, values)
        else:
            self._encode_unencoded()
            rows = self.encode(keys, values)
            self.slots.write(start, rows, live=self.length)
            self._keep_full_precision(start, keys, values, position)

    def step_call(self, start, position, live, scale, dtype):
        """Where calls are traced (``kernels.attention.traces``), a deferred token (``store``) is
        written into its ring row and attended to in one call (``GPU_OPS.decode_step``, made at the
        first step)."""
        if not traces():
            return None
        if self._step is None:
            make = getattr(self.ops, "decode_step", None)
            if make is None:
                return None
            self._step = make(self.key_codec, self.value_codec, self.budget)
        index = self._deferred_row(start, 1, dtype, position)
        if index is None:
            return None
        self._defer(index, start, position)
        return self._step(self.budget.sinks + index, self.rotation.signs, self.slots.read(), self._fp,
                          tuple(self._recent), live, scale, self._take)  # fmt: skip

    def _take(self, written) -> None:
        """The full-precision rows a ``step_call`` wrote, as the cache's."""
        self._fp = {"fp_keys": written[0], "fp_values": written[1]}

    def _defer(self, index: int, start: int, position: int) -> None:
        """Give ring row ``index`` to the deferred token of slot ``start`` (its full-precision copy
        is the caller's to write): the slot allocated, the codes of a deferred token the row
        still holds written first, and the slot recorded as held there and not yet encoded."""
        self.slots.reserve(start + 1, live=self.length)
        held = self._recent[index]
        if held != start and held in self._unencoded:
            self._encode_unencoded()
        self._recent[index], self._recent_positions[index] = start, position
        self._unencoded.add(start)

    @property
    def warm_up_steps(self) -> int:
        """A decode step defers its token's codes (``store``); the first step whose ring row
        holds a deferred token encodes the whole ring's at once: step ``ring + 1``."""
        return self.budget.ring + 1

    def _deferred_row(self, start: int, tokens: int, dtype: mx.Dtype, position: int) -> int | None:
        """The recent-ring row of a write whose codes ``store`` may leave for later, None for any
        other: one token, bound for a row it takes (the newest position of its row), in the
        dtype the ring keeps or in float32 (whose ring keeps float16).

        Coding float32 tokens from their float16 copies changes a few of the code words
        that coding them at once would write (a code at a decision boundary moves one
        level), by less than the codes' own error, and spares a float32 model's decode step
        its encode (measurements: docs/benchmarks.md,
        "plugins/butter-aura/butter_aura/cache.py")."""
        if tokens != 1 or start < self.budget.sinks or dtype not in (self.fp_dtype, mx.float32):
            return None
        index = self.budget.ring_index(start)
        return index if index is not None and position >= self._recent_positions[index] else None

    def _encode_unencoded(self) -> None:
        """Encode the ring slots ``store`` left without codes, from their full-precision rows,
        and write their codes: where calls are traced, in one call (``GPU_OPS.encode_into``); else
        one encode call, one write per run of consecutive slots."""
        if not self._unencoded:
            return
        slots = tuple(sorted(self._unencoded))
        self._unencoded = set()
        fp_rows = ring_rows(self.budget, slots)
        encode_into = getattr(self.ops, "encode_into", None)
        if encode_into is not None and traces():
            self.slots.replace(encode_into(
                self.slots.read(stacked=True), self._fp, kernel_params(fp_rows, mx.int32),
                kernel_params(slots, mx.int32), self.rotation.signs, self.key_codec, self.value_codec,
            ))  # fmt: skip
            return
        index = mx.array(fp_rows, dtype=mx.int32)
        rows = self.encode(mx.take(self._fp["fp_keys"], index, axis=2), mx.take(self._fp["fp_values"], index, axis=2))
        first = 0
        for i in range(1, len(slots) + 1):
            if i == len(slots) or slots[i] != slots[i - 1] + 1:
                run = rows if (first, i) == (0, len(slots)) else {
                    name: array[..., first:i, :] for name, array in rows.items()}
                self.slots.write(slots[first], run, live=self.length)
                first = i

    def _keep_full_precision(self, start: int, keys: mx.array, values: mx.array, position: int) -> None:
        """Copy the written rows that are sinks, and those that are now the newest position of
        their recent-ring row, into the full-precision rows."""
        budget, fp = self.budget, self._fp
        end = start + keys.shape[2]
        if end - start == 1 and start >= budget.sinks:  # a decode step's token: at most its own row
            index = budget.ring_index(start)
            if index is not None and position >= self._recent_positions[index]:
                self._keep_ring_row(index, start, keys, values, position)
            return
        if start < budget.sinks:
            stop = min(budget.sinks, end)
            fp["fp_keys"][:, :, start:stop] = keys[:, :, : stop - start].astype(self.fp_dtype)
            fp["fp_values"][:, :, start:stop] = values[:, :, : stop - start].astype(self.fp_dtype)
        # Only the last `ring` slots of a write can be the last of it to use their row.
        last_of_row: dict[int, int] = {}
        for slot in range(max(start, budget.base, end - budget.ring), end):
            index = budget.ring_index(slot)
            if index is not None:
                last_of_row[index] = slot
        taken = sorted(
            (index, slot) for index, slot in last_of_row.items()
            if position + slot - start >= self._recent_positions[index]
        )  # fmt: skip
        first = 0
        for i in range(1, len(taken) + 1):
            # A run of rows and slots that both step by one: one slice assignment each.
            if i < len(taken) and taken[i] == (taken[i - 1][0] + 1, taken[i - 1][1] + 1):
                continue
            (index, slot), n = taken[first], i - first
            rows, source = slice(budget.sinks + index, budget.sinks + index + n), slice(slot - start, slot - start + n)
            fp["fp_keys"][:, :, rows] = keys[:, :, source].astype(self.fp_dtype)
            fp["fp_values"][:, :, rows] = values[:, :, source].astype(self.fp_dtype)
            self._recent[index : index + n] = range(slot, slot + n)
            self._recent_positions[index : index + n] = range(position + slot - start, position + slot - start + n)
            first = i

    def _keep_ring_row(self, index: int, start: int, keys: mx.array, values: mx.array, position: int) -> None:
        """Copy one token into recent-ring row ``index``, which it takes."""
        self._copy_to_ring_row(index, keys, values)
        self._recent[index], self._recent_positions[index] = start, position

    def _copy_to_ring_row(self, index: int, keys: mx.array, values: mx.array) -> None:
        """Write one token's full-precision copy into recent-ring row ``index``."""
        row = self.budget.sinks + index
        self._fp["fp_keys"][:, :, row : row + 1] = keys.astype(self.fp_dtype)
        self._fp["fp_values"][:, :, row : row + 1] = values.astype(self.fp_dtype)

    def stored(self, length: int | None = None) -> StoredLayer:
        """What attention reads: the coded slots ``[0, length)`` (default: all live) and the full-precision rows."""
        length = self.length if length is None else length
        slots = self.slots.read()
        return StoredLayer(
            key_codes=slots["key_codes"],
            key_scales=slots["key_scales"],
            value_codes=slots["value_codes"],
            value_scales=slots["value_scales"],
            fp_keys=self._fp["fp_keys"],
            fp_values=self._fp["fp_values"],
            recent_slots=kernel_params(self._recent, mx.int32),
            length=length,
            budget=self.budget,
            key_codec=self.key_codec,
            value_codec=self.value_codec,
            rotation=self.rotation,
            recent_host=tuple(self._recent),
        )

    def load(self, length):
        self._encode_unencoded()
        if length == 0:
            empty = mx.zeros((self.spec.batch_size, self.spec.n_kv_heads, 0, self.spec.head_dim), self.spec.dtype)
            return empty, empty
        return self.ops.dequantize(self.stored(length), self.spec.dtype)

    # -- attention -------------------------------------------------------------

    def attention(self, queries, *, scale, mask):
        if queries.shape[2] == 1 and mask is None:
            return self.ops.decode_attention(queries, self.stored(), scale)
        keys, values = self.load(self.length)
        return self._submitted(attend(queries, keys, values, scale=scale, mask=mask))

    def store_and_attend(self, start, keys, values, position, queries, *, scale, mask):
        """A chunk's queries see the chunk's own keys and values as they arrived, not decoded from
        the codes just written (the codes' error would enter prefill attention twice); what came
        before is decoded once. One token goes through ``step_call`` where it serves, else
        ``attention`` (the decode kernel)."""
        if mask is None and keys.shape[2] == 1:
            return super().store_and_attend(start, keys, values, position, queries, scale=scale, mask=mask)
        self.write(start, keys, values, position)
        if not isinstance(mask, str) or start + keys.shape[2] != self.length:
            return self.attention(queries, scale=scale, mask=mask)
        past_keys, past_values = self.load(start)
        keys = mx.concatenate([past_keys, keys.astype(self.spec.dtype)], axis=2)
        values = mx.concatenate([past_values, values.astype(self.spec.dtype)], axis=2)
        return self._submitted(attend(queries, keys, values, scale=scale, mask=mask))

    def _submitted(self, out: mx.array) -> mx.array:
        """A multi-token attention's output, handed to ``pipeline`` (None: no bound) so that few
        layers' decoded K/V exist at once on a GPU (``butter_core.working_set``)."""
        if self.pipeline is not None:
            self.pipeline.submit(out)
        return out

    # -- state and accounting --------------------------------------------------

    def export_slots(self, length):
        self._encode_unencoded()
        return {
            **super().export_slots(length),
            # Copies: the cache keeps updating its own arrays in place.
            "fp_keys": mx.array(self._fp["fp_keys"]),
            "fp_values": mx.array(self._fp["fp_values"]),
            "recent_slots": mx.array([slot if slot < length else -1 for slot in self._recent], dtype=mx.int32),
            "recent_positions": mx.array(
                [at if slot < length else -1 for slot, at in zip(self._recent, self._recent_positions)], dtype=mx.int32
            ),
        }

    def import_slots(self, arrays, length):
        fp = {name: arrays[name] for name in FULL_PRECISION_ARRAYS if name in arrays}
        if len(fp) != len(FULL_PRECISION_ARRAYS):
            raise ConfigError(
                f"AuraCache state needs {FULL_PRECISION_ARRAYS} beside its slot arrays; got {sorted(arrays)}: "
                "it was exported by another kind of cache"
            )
        expected = {name: (array.shape, array.dtype) for name, array in self._empty_full_precision().items()}
        expected["recent_slots"] = expected["recent_positions"] = ((self.budget.ring,), mx.int32)
        for name, array in fp.items():
            if array.shape != expected[name][0]:
                raise ConfigError(
                    f"AuraCache state array {name} has shape {array.shape}, this cache holds {expected[name][0]}: "
                    "it was exported by a cache of another shape or capacity"
                )
        super().import_slots({k: v for k, v in arrays.items() if k not in FULL_PRECISION_ARRAYS}, length)
        self._fp = {name: mx.array(fp[name]).astype(expected[name][1]) for name in ("fp_keys", "fp_values")}
        self._recent = fp["recent_slots"].astype(mx.int32).tolist()
        self._recent_positions = fp["recent_positions"].astype(mx.int32).tolist()
        self._unencoded = set()

    def meta_state(self):
        return {**super().meta_state(), "rotation_seed": self.rotation.seed, "kind": str(self.kind)}

    def restore(self, state, meta):
        if "rotation_seed" not in meta or meta.get("kind") != str(self.kind):
            raise ConfigError(
                f"state meta {dict(meta)} was not exported by an {self.kind} cache (it needs 'kind' and 'rotation_seed')"
            )
        seed = int(meta["rotation_seed"])
        if seed != self.rotation.seed:
            self.rotation = Rotation(seed, self.spec.n_kv_heads, self.spec.head_dim, self.spec.shard)
        super().restore(state, meta)

    def truncate(self, length):
        super().truncate(length)
        self._unencoded = {slot for slot in self._unencoded if slot < length}
        for index, slot in enumerate(self._recent):
            if slot >= length:  # the row is free for the positions written there next
                self._recent[index] = self._recent_positions[index] = -1

    def buffers(self):
        return super().buffers() + list(self._fp.values()) + self.rotation.arrays()

    @property
    def nbytes_allocated(self) -> int:
        return super().nbytes_allocated + self._recent_nbytes

    @property
    def nbytes_live(self) -> int:
        return super().nbytes_live + sum(array.nbytes for array in self._fp.values()) + self._recent_nbytes

    @property
    def _recent_nbytes(self) -> int:
        """Bytes of the ``recent_slots`` array ``stored`` makes and of ``recent_positions``
        (int32 per ring row each), counted as held."""
        return 8 * self.budget.ring
