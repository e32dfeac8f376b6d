"""``butter plugins``: the installed schemes, and what this machine gives their GPU kernels."""

import json

import pytest

from butter_core.cli import main
from butter_core.cli.plugins_cmd import describe_gpu_kernels, gpu_kernels
from butter_core.kernels import backend as kernel_backend
from butter_core.kernels import recorded_builds
from butter_core.plugins import get_plugin_host


def test_plugins_lists_every_plugin_then_the_gpu_kernels_line(capsys):
    assert main(["plugins"]) == 0
    lines = capsys.readouterr().out.splitlines()
    records = get_plugin_host().plugins.values()
    assert records  # butter-core's own window plugin at least
    for record in records:
        assert f"{record.distribution} {record.version}  (plugin {record.name})" in lines
    assert lines[-1] == describe_gpu_kernels(gpu_kernels())


def test_plugins_json_has_the_gpu_kernels(capsys):
    assert main(["plugins", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) == {"plugins", "problems", "left_out", "gpu_kernels"}
    assert [plugin["name"] for plugin in data["plugins"]] == [record.name for record in get_plugin_host().plugins.values()]
    assert data["gpu_kernels"] == gpu_kernels()


def test_gpu_kernels_line_without_a_gpu_backend():
    assert describe_gpu_kernels({"backend": None, "compute_capability": None, "multiprocessors": None,
                                 "tensor_cores": False}) == (
        "GPU kernels: none (this MLX has no GPU backend; every scheme runs its pure-mx code)")


@pytest.mark.parametrize(("capability", "line"), [
    ((7, 5), "GPU kernels: cuda, compute capability 7.5, 132 multiprocessors; no tensor-core instructions, "
             "so schemes take their other kernels"),
    ((9, 0), "GPU kernels: cuda, compute capability 9.0, 132 multiprocessors"),
])
def test_gpu_kernels_line_on_cuda(monkeypatch, capability, line):
    """The device's compute capability stands in for one (``recorded_builds`` answers "cuda",
    and an H200's shape, ``backend.TUNED_ON``)."""
    monkeypatch.setattr(kernel_backend, "cuda_compute_capability", lambda: capability)
    with recorded_builds("cuda"):
        kernels = gpu_kernels()
    assert kernels == {"backend": "cuda", "compute_capability": list(capability), "multiprocessors": 132,
                       "tensor_cores": capability >= (8, 0)}
    assert describe_gpu_kernels(kernels) == line
