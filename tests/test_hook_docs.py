"""docs/plugin-authors.md documents every hook spec, with its real arguments, and nothing else.

Each hook has a heading ``### butter_name(arg, ...)`` under ``## Hook reference``; the
argument list must equal the spec's signature, so the docs cannot drift from
``butter_core/hookspecs.py``.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from butter_core import hookspecs

DOCS = Path(__file__).resolve().parent.parent / "docs" / "plugin-authors.md"
SECTION = "## Hook reference"
HEADING = re.compile(r"^### (butter_\w+)\(([^)]*)\)\s*$", re.MULTILINE)


def hook_specs() -> dict[str, object]:
    """Every function in hookspecs marked with ``@hookspec``, by name."""
    marker = f"{hookspecs.PROJECT}_spec"
    return {name: f for name, f in vars(hookspecs).items() if callable(f) and hasattr(f, marker)}


def documented_hooks() -> dict[str, list[str]]:
    """Hook name -> argument names, from the headings of the Hook reference section."""
    text = DOCS.read_text()
    assert SECTION in text, f"{DOCS.name} has no '{SECTION}' section"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    return {name: [a.strip() for a in args.split(",") if a.strip()] for name, args in HEADING.findall(section)}


SPECS = hook_specs()


def test_hookspecs_module_defines_hooks():
    assert SPECS, "no @hookspec functions found in butter_core/hookspecs.py"


@pytest.mark.parametrize("name", sorted(SPECS))
def test_hook_is_documented_with_its_signature(name):
    documented = documented_hooks()
    assert name in documented, (
        f"hook {name} has no '### {name}(...)' heading under '{SECTION}' in docs/plugin-authors.md"
    )
    assert documented[name] == list(inspect.signature(SPECS[name]).parameters), (
        f"docs/plugin-authors.md documents {name}({', '.join(documented[name])}); "
        f"the spec is {name}{inspect.signature(SPECS[name])}"
    )


def test_every_documented_hook_exists():
    unknown = sorted(set(documented_hooks()) - set(SPECS))
    assert not unknown, f"docs/plugin-authors.md documents hooks that butter_core/hookspecs.py lacks: {unknown}"


@pytest.mark.parametrize("name", sorted(SPECS))
def test_hook_spec_docstring_says_when_and_what(name):
    doc = inspect.getdoc(SPECS[name]) or ""
    assert doc, f"hook spec {name} has no docstring"
    assert "called" in doc.lower(), f"the docstring of {name} must say when it is called"
    assert "return" in doc.lower(), f"the docstring of {name} must say what it returns"
