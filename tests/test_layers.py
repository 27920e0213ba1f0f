"""Each dependency of the package points one way, read from the imports.

The installer imports the parts it installs, never the reverse: a part
reports to the installer through what the installer hands it at install
time. So no module the package's ``__init__`` reaches imports ``__init__``'s
namespace or ``installer`` back. (Modules outside that reach drive the patch
as a user does: ``__main__`` and the fidelity tool call ``apply()``.)
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers import ROOT

PACKAGE = "vllm_kvfill_patch"
SOURCE = ROOT / PACKAGE


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in SOURCE.rglob("*.py")}
"""The package's modules, by dotted name."""


def imported(source: str) -> set[str]:
    """What `source` imports from the package, anywhere in it, by dotted name:
    a module, or the package itself where a name is taken from its
    ``__init__``."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in MODULES else node.module)
    return {name for name in found if name.split(".")[0] == PACKAGE}


def reached_from(start: str, graph: dict[str, set[str]]) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += sorted(graph.get(name, ()))
    return seen


def back_imports(graph: dict[str, set[str]]) -> list[str]:
    """Each import of ``__init__`` or ``installer`` by a module that the
    package's ``__init__`` reaches (``installer`` included), as 'importer ->
    imported'."""
    targets = {PACKAGE, f"{PACKAGE}.installer"}
    reached = reached_from(PACKAGE, graph) - {PACKAGE}
    return sorted(
        f"{name} -> {target}"
        for name in reached
        for target in graph.get(name, set()) & targets
    )


def import_graph() -> dict[str, set[str]]:
    return {name: imported(path.read_text()) for name, path in MODULES.items()}


def test_no_module_the_package_reaches_imports_it_or_its_installer_back():
    graph = import_graph()
    assert {f"{PACKAGE}.installer", f"{PACKAGE}.options"} <= reached_from(
        PACKAGE, graph
    )
    assert back_imports(graph) == []


def test_a_part_that_imports_the_package_back_is_found():
    graph = import_graph()
    options, switches = f"{PACKAGE}.options", f"{PACKAGE}.switches"
    # As options reported the refill before the installer handed it a callback.
    graph[options] |= imported(
        "def check_options():\n"
        "    import vllm_kvfill_patch\n\n"
        "    vllm_kvfill_patch.refill_opted_in('refill_preempted')\n"
    )
    graph[switches] |= imported("from vllm_kvfill_patch.installer import status\n")
    assert back_imports(graph) == [
        f"{options} -> {PACKAGE}",
        f"{switches} -> {PACKAGE}.installer",
    ]
