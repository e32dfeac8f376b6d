"""butter_core.kernels.cuda_binaries: kernels compiled once per install and run through
``mx.fast.precompiled_cuda_kernel``. The rendering and naming run anywhere; running
binaries, and a second process loading them without compiling, need a CUDA GPU."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import mlx.core as mx
import pytest

from butter_core.kernels import Kernel, cuda_binaries
from butter_core.kernels.backend import gpu_backend

cuda = pytest.mark.skipif(gpu_backend() != "cuda", reason="runs CUDA kernels")

_BODY = """\
  const int i = static_cast<int>(global_idx.x);
  if (i < rows_shape[0] * rows_shape[1]) {
    out[i] = bt_from_float<T>(bt_to_float(rows[i]) * SCALE + bias[0]);
  }
"""
_KERNEL = Kernel("test_cuda_binaries_affine", ["rows", "bias"], ["out"], _BODY)


def _render(body_kernel=_KERNEL, scale=3, dtype=mx.bfloat16):
    return cuda_binaries.render(body_kernel, [("SCALE", scale), ("T", dtype)], [dtype, mx.float32], [2, 1], [dtype])


def test_render_passes_shapes_as_scalars_and_declares_template_values():
    rendered = _render()
    source = rendered.source
    assert f'extern "C" __global__ void {rendered.symbol}(' in source
    # MLX passes a precompiled kernel its inputs, its outputs, then its scalars.
    assert ("const __nv_bfloat16* rows,\n    const float* bias,\n    __nv_bfloat16* out,\n    int rows_shape_0,\n"
            "    int rows_shape_1) {") in source
    assert "const int rows_shape[2] = {rows_shape_0, rows_shape_1};" in source
    assert "bias_shape" not in source  # the body never reads it, so it is not passed
    assert "constexpr int SCALE = 3;" in source and "using T = __nv_bfloat16;" in source
    assert rendered.shaped_inputs == (0,)
    assert source.startswith(cuda_binaries.PRELUDE)


def test_symbol_follows_every_part_of_a_build():
    symbols = {_render().symbol, _render(scale=4).symbol, _render(dtype=mx.float16).symbol,
               cuda_binaries.render(_KERNEL, [("SCALE", 3), ("T", mx.bfloat16)], [mx.bfloat16, mx.float32], [3, 1],
                                    [mx.bfloat16]).symbol}
    assert len(symbols) == 4
    assert _render().symbol == _render().symbol
    assert all(s.startswith("bt_test_cuda_binaries_affine_") for s in symbols)


def test_a_kernel_reading_strides_is_refused_by_name():
    kernel = Kernel("test_cuda_binaries_strided", ["rows"], ["out"], "  out[0] = rows[rows_strides[0]];\n")
    with pytest.raises(cuda_binaries.CudaBinaryError, match="rows_strides"):
        cuda_binaries.render(kernel, [], [mx.float32], [1], [mx.float32])


def test_mlx_kernel_dir_follows_mlx_rules(monkeypatch, tmp_path):
    for name in ("MLX_PTX_CACHE_DIR", "TMPDIR", "TMP", "TEMP", "TEMPDIR"):
        monkeypatch.delenv(name, raising=False)
    assert cuda_binaries.mlx_kernel_dir() == cuda_binaries.Path("/tmp/mlx") / mx.__version__ / "ptx"
    monkeypatch.setenv("TMP", str(tmp_path / "tmp"))
    assert cuda_binaries.mlx_kernel_dir() == tmp_path / "tmp" / "mlx" / mx.__version__ / "ptx"
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "ptx"))
    assert cuda_binaries.mlx_kernel_dir() == tmp_path / "ptx"


def test_zero_turns_the_path_off(monkeypatch):
    """``BUTTER_CUDA_BINARIES=0`` compiles through MLX's JIT, even on a GPU whose probe passed."""
    monkeypatch.setenv(cuda_binaries.ENV_SWITCH, "0")
    cuda_binaries.available.cache_clear()
    try:
        assert not cuda_binaries.available()
    finally:
        cuda_binaries.available.cache_clear()


def test_the_path_needs_cuda(monkeypatch):
    """Unset, the path is on wherever MLX has CUDA (its probe passes there), and off elsewhere."""
    monkeypatch.delenv(cuda_binaries.ENV_SWITCH, raising=False)
    cuda_binaries.available.cache_clear()
    try:
        assert cuda_binaries.available() == mx.cuda.is_available()
    finally:
        cuda_binaries.available.cache_clear()


@pytest.mark.skipif(shutil.which("g++") is None, reason="compares with a C++ program's std::hash")
def test_std_hash_is_libstdcxx(tmp_path):
    words = ["", "a", "bt_butter_raw_sdpa_decode_partials_0123456789abcdef0123", "x" * 1000]
    program = tmp_path / "hash.cpp"
    program.write_text("#include <iostream>\n#include <string>\nint main() { std::string s;\n"
                       "  while (std::getline(std::cin, s)) std::cout << std::hash<std::string>{}(s) << '\\n'; }\n")
    subprocess.run(["g++", "-O1", "-o", str(tmp_path / "hash"), str(program)], check=True)
    out = subprocess.run([str(tmp_path / "hash")], input="\n".join(words) + "\n", capture_output=True, text=True,
                         check=True).stdout.split()
    assert [int(v) for v in out] == [cuda_binaries.std_hash(w.encode()) for w in words]


def test_module_path_is_what_mlx_names_the_module(monkeypatch, tmp_path):
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    symbol = _render().symbol
    assert cuda_binaries.module_path(symbol) == tmp_path / f"{symbol}_{cuda_binaries.std_hash(symbol.encode()):x}.ptx"


# ---- on a CUDA GPU --------------------------------------------------------------------------


def _affine(rows, bias, scale):
    return (rows.astype(mx.float32) * scale + bias[0]).astype(rows.dtype)


@pytest.fixture
def binaries_on(monkeypatch):
    """``cuda_binaries`` switched on for the test (it is opt-in), and its answer recomputed."""
    monkeypatch.setenv(cuda_binaries.ENV_SWITCH, "1")
    cuda_binaries.available.cache_clear()
    yield
    cuda_binaries.available.cache_clear()


@cuda
def test_kernels_run_from_binaries_and_match_the_reference(binaries_on):
    assert cuda_binaries.available()
    rows = mx.random.normal((5, 37)).astype(mx.bfloat16)
    bias = mx.array([0.25])
    (out,) = _KERNEL(inputs=[rows, bias], output_shapes=[rows.shape], output_dtypes=[rows.dtype],
                     grid=(5 * 37, 1, 1), threadgroup=(64, 1, 1), template=[("SCALE", 3), ("T", mx.bfloat16)])
    assert mx.array_equal(out, _affine(rows, bias, 3)).item()
    assert cuda_binaries.module_path(_render().symbol).exists()


_SECOND_PROCESS = textwrap.dedent("""
    import butter_core, sys
    import mlx.core as mx
    from butter_core.kernels import Kernel, cuda_binaries
    if sys.argv[1] == "forbid-compiling":
        def refuse(source, symbol):
            raise AssertionError("compiled " + symbol)
        cuda_binaries.compile_source = refuse
    kernel = Kernel("test_cuda_binaries_affine", ["rows", "bias"], ["out"], sys.stdin.read())
    rows = mx.arange(12, dtype=mx.float32).reshape(3, 4)
    (out,) = kernel(inputs=[rows, mx.array([1.0])], output_shapes=[rows.shape], output_dtypes=[mx.float32],
                    grid=(12, 1, 1), threadgroup=(32, 1, 1), template=[("SCALE", 2), ("T", mx.float32)])
    print(cuda_binaries.available(), out.tolist() == (rows * 2 + 1).tolist())
""")


def _second_process(tmp_path, *argv, butter_cache=None):
    env = dict(os.environ, MLX_PTX_CACHE_DIR=str(tmp_path / "ptx"), BUTTER_CACHE_DIR=str(butter_cache or tmp_path / "butter"),
               **{cuda_binaries.ENV_SWITCH: "1"})
    run = subprocess.run([sys.executable, "-c", _SECOND_PROCESS, *argv], input=_BODY, capture_output=True,
                         text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    return run.stdout.split(), run.stderr


@cuda
def test_a_second_process_runs_the_kernels_without_compiling(tmp_path):
    assert _second_process(tmp_path, "compile")[0] == ["True", "True"]
    assert _second_process(tmp_path, "forbid-compiling")[0] == ["True", "True"]
    shutil.rmtree(tmp_path / "ptx")  # MLX's directory wiped (a reboot cleared /tmp): butter's store refills it
    assert _second_process(tmp_path, "forbid-compiling")[0] == ["True", "True"]


@cuda
def test_where_the_probe_fails_kernels_compile_through_mlx_and_butter_says_why(tmp_path):
    (tmp_path / "a-file").write_text("")  # butter's cache directory cannot be made under a file
    (answers, stderr) = _second_process(tmp_path, "compile", butter_cache=tmp_path / "a-file" / "butter")
    assert answers == ["False", "True"]
    assert "CUDA kernels compile in every process" in stderr and "a-file" in stderr


@cuda
def test_a_kernel_nvrtc_rejects_stand_alone_runs_through_mlx_and_says_so(binaries_on):
    # WARP_SIZE comes from MLX's own prelude, which a stand-alone build does not include.
    kernel = Kernel("test_cuda_binaries_mlx_prelude", ["values"], ["out"],
                    "  out[thread_rank] = values[thread_rank] + static_cast<float>(WARP_SIZE);\n")
    values = mx.arange(32, dtype=mx.float32)
    with pytest.warns(UserWarning, match="test_cuda_binaries_mlx_prelude.*mx.fast.cuda_kernel"):
        (out,) = kernel(inputs=[values], output_shapes=[(32,)], output_dtypes=[mx.float32], grid=(32, 1, 1),
                        threadgroup=(32, 1, 1))
    assert mx.array_equal(out, values + 32).item()


def _nvrtc_loads() -> bool:
    try:
        cuda_binaries._nvrtc()
    except cuda_binaries.CudaBinaryError:
        return False
    return bool(cuda_binaries.include_paths())


@pytest.mark.skipif(not _nvrtc_loads(), reason="needs an NVRTC library (pip install nvidia-cuda-nvrtc) and CUDA headers")
def test_scheme_kernels_compile_stand_alone_with_nvrtc():
    from butter_core.kernels.cuda_compile_check import main

    assert main(["raw", "--capability", "9.0"]) == 0
    assert main(["raw", "--capability", "8.0"]) == 0
