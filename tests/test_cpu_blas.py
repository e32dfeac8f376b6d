"""butter_core.cpu_blas: OpenBLAS goes into the global namespace before MLX loads, unless told not to or too late."""

import ctypes.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

import butter_core

MODULE = Path(butter_core.__file__).parent / "cpu_blas.py"
# Run the module as a fresh process would at import time, before or after MLX.
SCRIPT = """
import importlib.util
import os
{before}
spec = importlib.util.spec_from_file_location("cpu_blas_probe", {path!r})
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
print(module.LOADED_BLAS, os.environ.get("OPENBLAS_THREAD_TIMEOUT"))
"""


def loaded_blas(*, choice: str | None = None, mlx_first: bool = False, timeout: str | None = None) -> str:
    """The library the module loads in a fresh process; with ``timeout``, also the
    ``OPENBLAS_THREAD_TIMEOUT`` it leaves (``timeout="-"``: not set beforehand)."""
    env = {k: v for k, v in os.environ.items() if k not in ("BUTTER_BLAS", "LD_PRELOAD", "OPENBLAS_THREAD_TIMEOUT")}
    if choice is not None:
        env["BUTTER_BLAS"] = choice
    if timeout not in (None, "-"):
        env["OPENBLAS_THREAD_TIMEOUT"] = timeout
    script = SCRIPT.format(before="import mlx.core" if mlx_first else "", path=str(MODULE))
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    library, thread_timeout = result.stdout.split()
    return library if timeout is None else f"{library} {thread_timeout}"


@pytest.mark.skipif(sys.platform != "linux", reason="the preload is for mlx-cpu on Linux")
def test_reference_choice_and_late_import_load_nothing():
    assert loaded_blas(choice="reference") == "None"
    assert loaded_blas(mlx_first=True) == "None"
    assert loaded_blas(choice="libno-such-blas.so") == "None"


@pytest.mark.skipif(ctypes.util.find_library("openblas") is None, reason="OpenBLAS is not installed (libopenblas0-pthread)")
def test_openblas_is_loaded_by_default():
    assert loaded_blas() == "libopenblas.so.0"


@pytest.mark.skipif(ctypes.util.find_library("openblas") is None, reason="OpenBLAS is not installed (libopenblas0-pthread)")
def test_openblas_threads_sleep_soon_unless_told_otherwise():
    assert loaded_blas(timeout="-") == "libopenblas.so.0 4"
    assert loaded_blas(timeout="28") == "libopenblas.so.0 28"
