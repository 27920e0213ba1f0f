"""The fidelity tool's parts that need neither vLLM nor a server (the
`report` session): its two layers and what they share. Its runs against
real servers: tests/engine/test_fidelity.py."""

from __future__ import annotations

import ast
from pathlib import Path

from vllm_kvfill_patch.fidelity import probe
from vllm_kvfill_patch.fidelity.modes import IDEAL, PACKAGE, UPSTREAM
from vllm_kvfill_patch.fidelity.serve import SITE, mismatch
from vllm_kvfill_patch.fidelity.wire import (
    COUNTS,
    Answer,
    Setting,
    question_line,
    read_question,
)

FIDELITY = "vllm_kvfill_patch.fidelity"
FIDELITY_DIR = Path(__file__).resolve().parent.parent / Path(*FIDELITY.split("."))
IN_SERVER = {"probe", "switch", "connector"}
"""What runs inside `vllm serve`: the tool starts it there by name (its
`sitecustomize`, `kv_connector_module_path`), never by importing it."""
SHARED = "wire"
"""The one module both layers import."""


def fidelity_imports(source: str) -> set[str]:
    """The fidelity modules a module of the tool imports, by short name,
    wherever the import statement is (a function's body too); relative
    imports are read from the tool's package."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            parts = FIDELITY.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1]) if node.level else ""
            module = ".".join(filter(None, [base, node.module]))
            names = [module, *(f"{module}.{alias.name}" for alias in node.names)]
        else:
            continue
        for name in names:
            if name.startswith(f"{FIDELITY}."):
                found.add(name.removeprefix(f"{FIDELITY}.").split(".")[0])
    return found


def layer_crossings() -> list[str]:
    """Each import of the tool that crosses between its layers other than
    through `SHARED`, as "importer imports imported"."""
    crossings = []
    for path in sorted(FIDELITY_DIR.glob("*.py")):
        importer = path.stem
        for imported in sorted(fidelity_imports(path.read_text())):
            if importer == SHARED:
                allowed = False  # it imports neither layer
            elif importer in IN_SERVER:
                allowed = imported in IN_SERVER or imported == SHARED
            else:
                allowed = imported not in IN_SERVER
            if not allowed:
                crossings.append(f"{importer} imports {imported}")
    return crossings


def test_what_runs_inside_vllm_serve_and_what_drives_it_meet_only_in_the_wire():
    assert (FIDELITY_DIR / f"{SHARED}.py").exists()
    assert {f"{name}.py" for name in IN_SERVER} <= {
        path.name for path in FIDELITY_DIR.glob("*.py")
    }
    assert layer_crossings() == []


def test_the_layer_check_finds_every_form_of_import():
    source = (
        "from vllm_kvfill_patch.fidelity import probe, wire\n"
        "import vllm_kvfill_patch.fidelity.switch as switched\n"
        "from vllm_kvfill_patch import options\n"
        "def later():\n"
        "    from .connector import SwitchedDecodeBenchConnector\n"
        "    from . import serve\n"
        "    from vllm_kvfill_patch.fidelity.cores import Placement\n"
    )
    assert fidelity_imports(source) == {
        "probe", "wire", "switch", "connector", "serve", "cores",
    }  # fmt: skip
    # The tool starts the probe by name, in a string: not an import.
    assert fidelity_imports(f"SITE = {SITE!r}\n") == set()


def test_a_setting_crosses_the_control_channel_and_each_process_is_checked():
    for setting in (UPSTREAM.setting, PACKAGE.setting, IDEAL.setting):
        assert setting is not None
        assert Setting.decoded(setting.encoded()) == setting
        assert " " not in setting.encoded()
        line = question_line(3, setting)
        assert line.endswith("\n") and line.count("\n") == 1
        assert read_question(line.strip()) == (3, setting.encoded())
    assert read_question(question_line(4).strip()) == (4, "")
    ideal = IDEAL.setting
    assert ideal is not None
    state = {"decision": "applied", "writes": False, "refill": [False]}
    assert mismatch(ideal, state) is None
    wrong = {"decision": "reverted", "writes": True, "refill": [True]}
    assert mismatch(ideal, wrong) == (
        "decision reverted, not applied; writes True, not False; "
        "refill [True], not False"
    )
    assert mismatch(ideal, {"skipped": "no connector in this process"}) is None


def test_a_probes_answer_holds_every_counter_the_tool_reads(tmp_path):
    answer = probe.Counters(tmp_path).snapshot(5)
    assert set(answer) == Answer.__required_keys__
    assert set(COUNTS) <= set(answer)
    assert answer["answered"] == 5
    assert answer["placement"]["process"]
