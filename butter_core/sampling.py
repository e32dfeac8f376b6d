"""Choosing the next token from logits: greedy, temperature, nucleus (top-p), seeded.

A :class:`Sampler` is called with one position's logits ``[vocab]`` and returns the
chosen id as a scalar ``mx.array``, so a decode loop can queue the next step before
the id reaches Python. A seeded sampler draws the same sequence every run: its random
key is split once per call.
"""

from __future__ import annotations

import math
import secrets

import mlx.core as mx

from butter_core.errors import ConfigError


class Sampler:
    """Greedy when ``temperature`` is 0; else softmax(logits / temperature) restricted to the top-p mass."""

    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None):
        if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
            raise ConfigError(f"temperature (--temp) must be a finite number >= 0 (0 is greedy); got {temperature!r}")
        if not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
            raise ConfigError(f"top_p (--top-p) must be in (0, 1]; got {top_p!r}")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**64):
            raise ConfigError(f"seed (--seed) must be an integer in [0, 2**64); got {seed!r}")
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.seed = seed
        self._key = mx.random.key(secrets.randbits(64) if seed is None else seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def __call__(self, logits: mx.array) -> mx.array:
        """The chosen token id (a scalar uint32 array) for ``logits`` of shape ``[vocab]``."""
        if self.greedy:
            return mx.argmax(logits, axis=-1).astype(mx.uint32)
        self._key, key = mx.random.split(self._key)
        scaled = logits.astype(mx.float32) / self.temperature
        if self.top_p >= 1:
            return mx.random.categorical(scaled, key=key).astype(mx.uint32)
        order = mx.argsort(-scaled, axis=-1)
        ranked = scaled[order]
        probs = mx.softmax(ranked, axis=-1)
        # Keep the smallest prefix of the ranking whose mass reaches top_p (the top token always stays).
        inside = (mx.cumsum(probs, axis=-1) - probs) < self.top_p
        choice = mx.random.categorical(mx.where(inside, ranked, -mx.inf), key=key)
        return order[choice].astype(mx.uint32)

    def __repr__(self) -> str:
        return f"Sampler(temperature={self.temperature}, top_p={self.top_p}, seed={self.seed})"


GREEDY = Sampler()
"""The argmax sampler (stateless, so one instance serves everyone)."""
