"""The randomized Hadamard rotation AURA applies to every key and value before coding.

Per layer and KV head the rotation is ``R x = H (s ⊙ x)[π]``: random signs ``s`` (±1), a
permutation ``π`` and a normalized Walsh–Hadamard transform ``H``. For a power-of-two
``head_dim`` ``π`` is the identity and ``H`` is one normalized Hadamard transform over
the whole vector: the randomized Hadamard transform. Otherwise ``head_dim`` is split into
power-of-two blocks (96 = 64 + 32) and ``H`` is block-diagonal, with a random
permutation in front so that each block mixes a random subset of the coordinates; unlike
padding to the next power of two (the textbook subsampled transform) this costs no extra
codes. Either way ``R`` is exactly orthogonal, so ``q·k = Rq·Rk`` and ``R⁻¹ = Rᵀ``.

Signs and permutation come from ``mx.random`` under a key made from an integer seed
(MLX's counter-based generator gives the same bits on every backend), so the seed kept
in a cache's meta state rebuilds the same rotation on restore. Nothing but the signs
(and, for other head sizes, the permutations) is stored: the transform runs as
``log2(head_dim)`` butterfly stages, here in pure mx and in the kernels in shared memory.
The CPU path (``butter_aura.cpu``) runs the stages as one matmul instead, where that
costs less than their many small ops (``mixing_matrix``).
"""

from __future__ import annotations

import math

import attrs
import mlx.core as mx


def power_of_two_blocks(n: int) -> list[int]:
    """``n`` as a sum of distinct powers of two, largest first (96 -> [64, 32])."""
    if n <= 0:
        raise ValueError(f"head_dim must be positive, got {n}")
    return [1 << bit for bit in range(n.bit_length() - 1, -1, -1) if n >> bit & 1]


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def fwht(x: mx.array) -> mx.array:
    """Normalized Walsh–Hadamard transform over the last axis (a power of two long), in float32.

    Sylvester ordering; the transform is symmetric and its own inverse.
    """
    n = x.shape[-1]
    if not is_power_of_two(n):
        raise ValueError(f"fwht needs a power-of-two length, got {n}")
    lead = x.shape[:-1]
    y = x.astype(mx.float32)
    h = 1
    while h < n:
        pairs = y.reshape(*lead, n // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = mx.stack([a + b, a - b], axis=-2).reshape(*lead, n)
        h *= 2
    return y * (1.0 / math.sqrt(n))


def block_fwht(x: mx.array) -> mx.array:
    """``fwht`` applied to each power-of-two block of the last axis (see ``power_of_two_blocks``)."""
    blocks = power_of_two_blocks(x.shape[-1])
    if len(blocks) == 1:
        return fwht(x)
    starts = [sum(blocks[:i]) for i in range(len(blocks))]
    return mx.concatenate([fwht(x[..., s : s + b]) for s, b in zip(starts, blocks)], axis=-1)


def layer_seed(base_seed: int, layer_index: int) -> int:
    """The rotation seed of one layer: distinct per layer, stable for a given base seed."""
    return (base_seed * 1_000_003 + layer_index) % (1 << 31)


@attrs.frozen(eq=False)
class Rotation:
    """The rotations of one layer's ``heads`` KV heads, made from ``seed``; with ``shard`` ``(rank,
    ranks)`` (tensor parallelism: ``LayerSpec.shard``) those of heads ``[rank * heads, (rank + 1) *
    heads)`` of a layer of ``ranks * heads``, drawn for all of them and sliced, so that each rank's
    heads rotate as one process's do.

    ``apply`` and ``invert`` act on ``[..., heads, tokens, dims]`` arrays (the KV-head
    axis third from last) and return float32.
    """

    seed: int
    heads: int
    dims: int
    shard: tuple[int, int] = (0, 1)
    signs: mx.array = attrs.field(init=False)
    """``[heads, dims]`` float32, ±1."""
    permutation: mx.array | None = attrs.field(init=False)
    """``[heads, dims]`` int32, or None when ``dims`` is a power of two (identity)."""
    inverse_permutation: mx.array | None = attrs.field(init=False)
    mixing: mx.array | None = attrs.field(init=False, default=None)
    """``mixing_matrix()`` once built, else None."""

    def __attrs_post_init__(self):
        sign_key, perm_key = mx.random.split(mx.random.key(self.seed))
        rank, ranks = self.shard
        mine = slice(rank * self.heads, (rank + 1) * self.heads)
        bits = mx.random.bernoulli(0.5, (ranks * self.heads, self.dims), key=sign_key)[mine]
        object.__setattr__(self, "signs", mx.where(bits, 1.0, -1.0).astype(mx.float32))
        perm = inverse = None
        if not is_power_of_two(self.dims):
            uniform = mx.random.uniform(shape=(ranks * self.heads, self.dims), key=perm_key)[mine]
            perm = mx.argsort(uniform, axis=-1).astype(mx.int32)
            inverse = mx.argsort(perm, axis=-1).astype(mx.int32)
        object.__setattr__(self, "permutation", perm)
        object.__setattr__(self, "inverse_permutation", inverse)
        # Materialise now: a constant that stays a lazy graph keeps its random-key inputs alive.
        mx.eval(self.arrays())

    def arrays(self) -> list[mx.array]:
        """Every array this rotation holds (for byte accounting)."""
        return [a for a in (self.signs, self.permutation, self.inverse_permutation, self.mixing) if a is not None]

    def apply(self, x: mx.array) -> mx.array:
        """``R x`` per head: rotated vectors, float32."""
        y = x.astype(mx.float32) * self.signs[:, None, :]
        if self.permutation is not None:
            y = mx.take_along_axis(y, mx.broadcast_to(self.permutation[:, None, :], y.shape), axis=-1)
        return block_fwht(y)

    def invert(self, y: mx.array) -> mx.array:
        """``Rᵀ y`` per head: the vectors whose rotation is ``y``, float32."""
        z = block_fwht(y)
        if self.inverse_permutation is not None:
            z = mx.take_along_axis(z, mx.broadcast_to(self.inverse_permutation[:, None, :], z.shape), axis=-1)
        return z * self.signs[:, None, :]

    def matrices(self) -> mx.array:
        """``[heads, dims, dims]`` dense ``R`` (for tests and analysis)."""
        eye = mx.broadcast_to(mx.eye(self.dims, dtype=mx.float32), (self.heads, self.dims, self.dims))
        return self.apply(eye).swapaxes(-1, -2)

    def mixing_matrix(self) -> mx.array:
        """``M`` with ``apply(x) == (x * signs) @ M`` and ``invert(y) == (y @ Mᵀ) * signs``, per head.

        The permutation and Hadamard stages as one matrix on row vectors, for the CPU
        path, where a small matmul costs less than the stages' many small ops: for a
        power-of-two ``dims`` the normalized Hadamard matrix ``[dims, dims]`` (symmetric;
        16 KB at 64), otherwise ``[heads, dims, dims]`` ``diag(signs) Rᵀ``. Built on first
        use and kept, counted by ``arrays``; the GPU kernels never build it.
        """
        if self.mixing is None:
            if is_power_of_two(self.dims):
                mixing = fwht(mx.eye(self.dims, dtype=mx.float32))
            else:
                mixing = self.signs[:, :, None] * self.matrices().swapaxes(-1, -2)
            mx.eval(mixing)
            object.__setattr__(self, "mixing", mixing)
        return self.mixing


@attrs.frozen(eq=False)
class TracedRotation:
    """What the kernels read of a ``Rotation`` inside a traced call: its signs (the trace's input),
    and no permutation (the kernels serve power-of-two head sizes only)."""

    signs: mx.array
    permutation: None = None
