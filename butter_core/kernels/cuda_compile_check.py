"""Every CUDA build of a scheme's kernel checks compiled stand-alone by NVRTC, without a GPU.

``butter_core.kernels.cuda_binaries`` renders each build as its own translation unit (its
own prelude instead of MLX's) and compiles it with NVRTC. Whether every kernel compiles
that way needs NVRTC only: ``pip install nvidia-cuda-nvrtc`` (CUDA 13, as MLX's CUDA wheels)
and CUDA's headers (``CUDA_HOME``, ``/usr/local/cuda`` or MLX's CUDA wheel) are enough.
"""

from __future__ import annotations

import argparse
import sys
import time

from butter_core.kernels import cuda_binaries
from butter_core.kernels.checks import recorded_check_builds


def main(argv: list[str] | None = None) -> int:
    """``python -m butter_core.kernels.cuda_compile_check SCHEME [CHECK ...] [--capability 9.0]``:
    every CUDA build an installed scheme's kernel checks make (recorded, nothing run),
    rendered stand-alone and compiled by NVRTC for that compute capability; non-zero if one
    does not compile. Needs an NVRTC library, not a GPU."""
    from butter_core.plugins import get_plugin_host  # noqa: PLC0415 - only the command needs the plugins

    parser = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    parser.add_argument("scheme", help="an installed scheme (butter plugins lists them)")
    parser.add_argument("checks", nargs="*", help="only these kernel checks (default: all built for CUDA)")
    parser.add_argument("--capability", default="9.0", help="compute capability to compile for (default 9.0)")
    args = parser.parse_args(argv)
    capability = tuple(int(part) for part in args.capability.split("."))
    schemes = get_plugin_host().schemes
    if args.scheme not in schemes:
        parser.error(f"no scheme {args.scheme!r}; installed: {', '.join(sorted(schemes))}")
    checks = [c for c in schemes[args.scheme].scheme.kernel_checks()
              if "cuda" in c.backends and (not args.checks or c.name in args.checks)]
    rendered = {r.symbol: r for r in map(cuda_binaries.render_build, recorded_check_builds(checks, "cuda"))}
    failed = 0
    for symbol, build in rendered.items():
        start = time.perf_counter()
        try:
            size = len(cuda_binaries.compile_source(build.source, symbol, capability))
            print(f"ok   {symbol} {size / 1024:.0f} KB {time.perf_counter() - start:.1f} s", flush=True)
        except cuda_binaries.CudaBinaryError as error:
            failed += 1
            print(f"FAIL {symbol}\n{error}", flush=True)
    print(f"{failed} of {len(rendered)} builds failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
