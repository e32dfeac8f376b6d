"""Fail unless exactly the given butter distributions are installed, each from this checkout.

tox runs this before the tests, so a plugin env never tests a copy that came from PyPI
or a stale install. Arguments are project folders (each with a pyproject.toml).
Usage: python tools/check_installed.py . plugins/butter-raw
"""

import json
import sys
import tomllib
from importlib import metadata
from pathlib import Path
from urllib.parse import unquote, urlparse

CHECKOUT = Path(__file__).resolve().parent.parent


def main(expected: list[str]) -> int:
    ours = {d.metadata["Name"].lower(): d for d in metadata.distributions() if d.metadata["Name"].lower().startswith("butter-")}
    errors = []
    if set(ours) != set(expected):
        errors.append(f"installed butter distributions {sorted(ours)} != expected {sorted(expected)}")
    for name, dist in sorted(ours.items()):
        origin = dist.read_text("direct_url.json")
        path = Path(unquote(urlparse(json.loads(origin)["url"]).path)) if origin else None
        if path is None or not path.resolve().is_relative_to(CHECKOUT):
            errors.append(f"{name} {dist.version} was not installed from this checkout ({path or 'no direct_url.json: from an index'})")
    for error in errors:
        print(f"check_installed: {error}", file=sys.stderr)
    if not errors:
        print(f"check_installed: {', '.join(sorted(ours))} from {CHECKOUT}")
    return 1 if errors else 0


def project_name(folder: str) -> str:
    with open(Path(folder) / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["name"].lower()


if __name__ == "__main__":
    sys.exit(main([project_name(folder) for folder in sys.argv[1:]]))
