"""The plugin surface: every name docs/plugin-authors.md lists is importable from
``butter_core.plugin_api``, nothing more is exported, and the plugins in this checkout
(ours and the example third party's) import nothing else of core in their library code."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import butter_core.plugin_api as plugin_api

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "plugin-authors.md"
PLUGIN_PACKAGES = sorted(
    path
    for parent in (ROOT / "plugins", ROOT / "examples")
    for path in parent.glob("*/butter_*")
    if path.is_dir()
)


def documented_names() -> list[str]:
    """The names in the guide's table of what ``butter_core.plugin_api`` holds."""
    table = GUIDE.read_text().split("names in `butter_core.plugin_api`", 1)[1].split("\n\n", 1)[0]
    return [name for row in table.splitlines()[2:] for name in re.findall(r"`(\w+)`", row.split("|")[2])]


def test_every_documented_name_is_importable():
    names = documented_names()
    assert len(names) > 20, "the guide's table of plugin_api names was not found"
    missing = [name for name in names if not hasattr(plugin_api, name)]
    assert not missing, f"docs/plugin-authors.md lists names butter_core.plugin_api lacks: {missing}"


def test_nothing_undocumented_is_exported():
    assert sorted(plugin_api.__all__) == sorted(documented_names())


@pytest.mark.parametrize("package", PLUGIN_PACKAGES, ids=lambda p: p.name)
def test_plugins_import_core_only_through_the_plugin_api(package):
    stray = []
    for source in package.rglob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            module = node.module if isinstance(node, ast.ImportFrom) else None
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [module or ""]
            stray += [f"{source.relative_to(ROOT)}: {name}" for name in names
                      if name.startswith("butter_core") and name != "butter_core.plugin_api"]  # fmt: skip
    assert not stray, "library code imports core outside butter_core.plugin_api:\n" + "\n".join(stray)


def test_core_defines_no_scheme_kind():
    """Each plugin owns its configuration: no CacheKind subclass of ours lives in core."""
    core = ROOT / "butter_core"
    kinds = []
    for source in core.rglob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.ClassDef) and any(getattr(b, "id", None) == "CacheKind" for b in node.bases):
                kinds.append(f"{source.relative_to(ROOT)}: {node.name}")
    assert not kinds, f"scheme kinds defined in core (they belong to their plugins): {kinds}"
