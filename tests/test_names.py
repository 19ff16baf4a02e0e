"""Every module-level name a function or class body reads is defined in its module or is a builtin.

The CPU suite cannot run some code paths (the Gluon launcher, which has no interpreter; CUDA-only
branches), so a misspelt or deleted name there would first fail on the GPU. This reads each source
file's symbol table (no import, no execution) and names any such reference.
"""

from __future__ import annotations

import builtins
import pathlib
import symtable

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCES = sorted(p for d in ("cs336_systems", "cs336_basics", "tests", "runs") for p in (ROOT / d).rglob("*.py"))
MODULE_DUNDERS = {"__file__", "__name__", "__doc__", "__spec__", "__package__", "__builtins__", "__path__",
                  "__loader__"}


def undefined_globals(source: str, filename: str) -> list[tuple[str, int, str]]:
    """(scope, line, name) for each global name a nested scope reads that the module never binds (at its top
    level, or in a function that declares the name `global` and assigns it)."""
    top = symtable.symtable(source, filename, "exec")
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}

    def declared(table: symtable.SymbolTable) -> set[str]:
        names = set()
        for child in table.get_children():
            names |= {s.get_name() for s in child.get_symbols() if s.is_declared_global() and s.is_assigned()}
            names |= declared(child)
        return names

    known = bound | declared(top) | set(dir(builtins)) | MODULE_DUNDERS
    missing = []

    def walk(table: symtable.SymbolTable) -> None:
        for child in table.get_children():
            missing.extend((child.get_name(), child.get_lineno(), s.get_name()) for s in child.get_symbols()
                           if s.is_global() and s.is_referenced() and s.get_name() not in known)
            walk(child)

    walk(top)
    return missing


def test_checker_finds_an_undefined_name():
    source = "import torch\n\ndef launch(x):\n    compiled = kernel[x]\n    return torch.zeros(compiled)\n"
    assert undefined_globals(source, "example.py") == [("launch", 3, "kernel")]
    bound_later = "def register():\n    global kernel\n    kernel = 1\n\ndef launch():\n    return kernel\n"
    assert undefined_globals(bound_later, "example.py") == []


@pytest.mark.parametrize("path", SOURCES, ids=[str(p.relative_to(ROOT)) for p in SOURCES])
def test_module_names_are_defined(path):
    assert undefined_globals(path.read_text(), str(path)) == []
