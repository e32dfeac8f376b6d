"""``butter plugins [--json]``: installed schemes with their distribution, version and hooks,
and what this machine gives GPU kernels."""

from __future__ import annotations

import json

from butter_core.kernels import backend as kernel_backend
from butter_core.kernels import gpu_backend, tensor_cores_available
from butter_core.plugins import LOAD_PLUGINS_ENV, get_plugin_host


def add_parser(sub) -> None:
    parser = sub.add_parser("plugins", help="list installed cache schemes and plugin problems")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(run=run)


def run(args) -> int:
    host = get_plugin_host()
    plugins = [
        {
            "name": record.name,
            "distribution": record.distribution,
            "version": record.version,
            "hooks": record.hooks,
            "schemes": [
                {"name": s, "examples": list(host.scheme_of(record, s).examples),
                 "description": host.scheme_of(record, s).description, "contested": s in host.contested}
                for s in record.schemes
            ],  # fmt: skip
            "evictions": record.evictions,
        }
        for record in host.plugins.values()
    ]
    problems = [{"distribution": p.distribution, "entry_point": p.entry_point, "message": p.message} for p in host.problems]
    left_out = [{"distribution": dist, "entry_point": name} for dist, name in host.left_out]
    kernels = gpu_kernels()
    if args.json:
        print(json.dumps({"plugins": plugins, "problems": problems, "left_out": left_out, "gpu_kernels": kernels}, indent=2))
        return 0
    for plugin in plugins:
        print(f"{plugin['distribution']} {plugin['version']}  (plugin {plugin['name']})")
        for scheme in plugin["schemes"]:
            contested = " (contested: not used, see the problems below)" if scheme["contested"] else ""
            print(f"  scheme {scheme['name']}{contested}: {', '.join(scheme['examples'])} - {scheme['description']}")
        for policy in plugin["evictions"]:
            print(f"  eviction {policy}")
        print(f"  hooks: {', '.join(plugin['hooks'])}")
    for problem in problems:
        print(f"problem: {problem['distribution']} ({problem['entry_point']}): {problem['message']}")
    for plugin in left_out:
        print(f"not loaded ({LOAD_PLUGINS_ENV} leaves it out): {plugin['distribution']} ({plugin['entry_point']})")
    print(describe_gpu_kernels(kernels))
    return 0


def gpu_kernels() -> dict:
    """What this machine gives the schemes' GPU kernels: MLX's GPU backend (None: CPU only)
    and, on CUDA, the device's compute capability, its multiprocessors (what split plans
    size their launches by) and whether tensor-core kernels run."""
    backend = gpu_backend()
    capability = kernel_backend.cuda_compute_capability() if backend == "cuda" else None
    multiprocessors = kernel_backend.gpu_shape().multiprocessors if backend == "cuda" else None
    return {"backend": backend, "compute_capability": list(capability) if capability else None,
            "multiprocessors": multiprocessors, "tensor_cores": tensor_cores_available()}


def describe_gpu_kernels(kernels: dict) -> str:
    """``gpu_kernels`` as one line."""
    if kernels["backend"] is None:
        return "GPU kernels: none (this MLX has no GPU backend; every scheme runs its pure-mx code)"
    line = f"GPU kernels: {kernels['backend']}"
    if kernels["compute_capability"]:
        line += ", compute capability {}.{}".format(*kernels["compute_capability"])
    if kernels["multiprocessors"]:
        line += f", {kernels['multiprocessors']} multiprocessors"
    if not kernels["tensor_cores"]:
        line += "; no tensor-core instructions, so schemes take their other kernels"
    return line
