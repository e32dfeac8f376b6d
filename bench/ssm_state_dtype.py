"""How much keeping a recurrent state in 16 bits costs: outputs against a float32 state.

Decodes ``--tokens`` positions one at a time (the state is rounded to its dtype after every
token, as in generation) through butter-ssm caches of each state dtype, for a Mamba2 layer
(8 heads of 64, state 128) and a gated delta layer (2 key / 4 value heads, Dk = Dv = 128),
model dtype bfloat16, random weights of a real layer's scale (``butter_core.testing``'s).
Prints the relative error of the outputs of the last 32 positions before each checkpoint
against the same run with a float32 state.

    python bench/ssm_state_dtype.py --tokens 2048
"""

from __future__ import annotations

import argparse

import mlx.core as mx

from butter_core import make_layer_caches, parse_kv_cache
from butter_core.recurrent import GATED_DELTA, MAMBA2, StateSpec
from butter_core.testing.recurrent_tests import random_inputs, random_mixer
from butter_core.testing.reference import relative_error

SHAPES = {
    MAMBA2: StateSpec(MAMBA2, conv_dim=8 * 64 + 2 * 128, conv_kernel=4, state_shape=(8, 64, 128), dtype=mx.bfloat16),
    GATED_DELTA: StateSpec(GATED_DELTA, conv_dim=2 * 2 * 128 + 4 * 128, conv_kernel=4, state_shape=(4, 128, 128),
                           dtype=mx.bfloat16),  # fmt: skip
}
KINDS = ("ssm", "ssm-bfloat16", "ssm-float16")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    args = parser.parse_args()
    checkpoints = sorted({min(args.tokens, c) for c in (128, 512, 2048, 8192)})
    print(f"MLX {mx.__version__}, device {mx.default_device()}, model dtype bfloat16; "
          f"relative error of outputs against a float32 state")  # fmt: skip
    print(f"{'layer':<12} {'state':<14} " + " ".join(f"{f'@{c}':>10}" for c in checkpoints))
    for layer_type, spec in SHAPES.items():
        mixer = random_mixer(spec)
        caches = {kind: make_layer_caches(parse_kv_cache(kind), [spec])[0] for kind in KINDS}
        outputs = {kind: [] for kind in KINDS}
        errors = {kind: [] for kind in KINDS}
        for t in range(1, args.tokens + 1):
            inputs = random_inputs(spec, 1, mx.random.key(t))
            for kind, cache in caches.items():
                outputs[kind].append(cache.update_and_mix(mixer, *inputs))
            mx.eval([o[-1] for o in outputs.values()])
            if t in checkpoints:
                exact = mx.concatenate(outputs["ssm"][-32:], axis=1)
                for kind in KINDS:
                    errors[kind].append(relative_error(mx.concatenate(outputs[kind][-32:], axis=1), exact))
                outputs = {kind: [] for kind in KINDS}
        for kind in KINDS[1:]:
            print(f"{layer_type:<12} {kind:<14} " + " ".join(f"{e:>10.2e}" for e in errors[kind]))


if __name__ == "__main__":
    main()
