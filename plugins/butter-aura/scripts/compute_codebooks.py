"""Compute AURA's scalar Lloyd–Max codebooks offline and write ``butter_aura/codebooks.json``.

What is quantized: after the randomized Hadamard rotation, a group of ``g`` rotated
coordinates is divided by its root mean square. For a rotated vector that is close to
isotropic, ``sqrt(g) * u`` with ``u`` one coordinate of a uniform unit vector in R^g is
the exact law of such a normalized coordinate; its density is

    p_g(t) ∝ (1 - t² / g) ** ((g - 3) / 2),   |t| < sqrt(g),

which tends to the standard Gaussian as g grows. For each bit width and group size this
script runs Lloyd's algorithm (boundaries at midpoints, levels at conditional means) on
that density, discretised on a fine grid, from a Panter–Dite (density^(1/3) companding)
start, until no level moves by more than 1e-10. It records the levels (ascending,
symmetric) and the mean squared error per unit variance.

Usage (needs numpy and scipy; neither is a runtime dependency of butter-aura):

    python plugins/butter-aura/scripts/compute_codebooks.py
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from scipy import special

BITS = (2, 3, 4, 8)
GROUPS = (16, 32, 64, 128, 256)
GRID = 400_001
TOLERANCE = 1e-10
MAX_ITERATIONS = 200_000
OUT = Path(__file__).resolve().parents[1] / "butter_aura" / "codebooks.json"


def normalized_coordinate_density(group: int) -> tuple[np.ndarray, np.ndarray]:
    """A grid over (-sqrt(g), sqrt(g)) and the probability mass of each grid point."""
    radius = np.sqrt(group)
    t = np.linspace(-radius, radius, GRID)
    log_norm = special.gammaln(group / 2) - special.gammaln((group - 1) / 2) - 0.5 * np.log(np.pi * group)
    mass = np.exp(log_norm) * np.clip(1 - t * t / group, 0, None) ** ((group - 3) / 2)
    return t, mass / mass.sum()


def lloyd_max(bits: int, group: int) -> tuple[np.ndarray, float]:
    """Lloyd–Max levels for ``2**bits`` cells under ``p_group``, and their MSE."""
    t, mass = normalized_coordinate_density(group)
    cdf, first_moment = np.cumsum(mass), np.cumsum(mass * t)
    n = 2**bits
    companded = np.cumsum(mass ** (1 / 3))
    levels = np.interp((np.arange(n) + 0.5) / n, companded / companded[-1], t)
    for _ in range(MAX_ITERATIONS):
        cut = np.searchsorted(t, (levels[1:] + levels[:-1]) / 2)
        p = np.diff(np.concatenate([[0.0], cdf[cut - 1], [1.0]]))
        m = np.diff(np.concatenate([[0.0], first_moment[cut - 1], [first_moment[-1]]]))
        new = m / np.maximum(p, 1e-300)
        moved = np.max(np.abs(new - levels))
        levels = new
        if moved < TOLERANCE:
            break
    levels = (levels - levels[::-1]) / 2  # exactly symmetric
    nearest = levels[np.searchsorted((levels[1:] + levels[:-1]) / 2, t)]
    return levels, float(np.sum(mass * (t - nearest) ** 2))


def main() -> None:
    books = {}
    for bits in BITS:
        for group in GROUPS:
            levels, mse = lloyd_max(bits, group)
            books[f"{bits}/{group}"] = {"bits": bits, "group": group, "mse": mse, "levels": [float(x) for x in levels]}
            print(f"bits {bits} group {group:3d}: mse {mse:.6g}")
    document = {
        "about": "Lloyd-Max levels for a rotated coordinate divided by its group's RMS; "
        "made by scripts/compute_codebooks.py",
        "codebooks": books,
    }
    OUT.write_text(json.dumps(document, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
