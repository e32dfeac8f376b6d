"""``butter plugins [--json]``: installed schemes with their distribution, version and hooks."""

from __future__ import annotations

import json

from butter_core.plugins import get_plugin_host


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
                {"name": s, "examples": list(host.schemes[s].scheme.examples), "description": host.schemes[s].scheme.description}
                for s in record.schemes
            ],
            "evictions": record.evictions,
        }
        for record in host.plugins.values()
    ]
    problems = [{"distribution": p.distribution, "entry_point": p.entry_point, "message": p.message} for p in host.problems]
    if args.json:
        print(json.dumps({"plugins": plugins, "problems": problems}, indent=2))
        return 0
    for plugin in plugins:
        print(f"{plugin['distribution']} {plugin['version']}  (plugin {plugin['name']})")
        for scheme in plugin["schemes"]:
            print(f"  scheme {scheme['name']}: {', '.join(scheme['examples'])} - {scheme['description']}")
        for policy in plugin["evictions"]:
            print(f"  eviction {policy}")
        print(f"  hooks: {', '.join(plugin['hooks'])}")
    for problem in problems:
        print(f"problem: {problem['distribution']} ({problem['entry_point']}): {problem['message']}")
    return 0
