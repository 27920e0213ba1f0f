"""The built wheel, installed (not editable) next to a real vLLM.

Run by `python3 -m nox -s wheel`, from a directory outside the checkout, so
every child below imports the installed package, not the checkout's.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

from tests import children
from tests.helpers import (
    DECODE_NODE_DEFAULT,
    applied_defects,
    patches_by_release,
    run_fresh,
    status_command,
)


def installed_distribution() -> metadata.Distribution:
    """The distribution in site-packages: pytest puts the checkout on sys.path,
    where an editable build left its egg-info, which importlib.metadata would
    find first."""
    site = sysconfig.get_paths()["purelib"]
    (found,) = metadata.distributions(name="vllm-kvfill-patch", path=[site])
    return found


def test_the_installed_package_is_the_wheel_not_the_checkout():
    distribution = installed_distribution()
    assert distribution.read_text("direct_url.json") is None or (
        '"editable": true' not in distribution.read_text("direct_url.json")
    )
    (entry_point,) = distribution.entry_points.select(group="vllm.general_plugins")
    assert entry_point.value == "vllm_kvfill_patch:load_vllm_plugin"
    requires = sorted(r.split(">")[0].split("<")[0] for r in distribution.requires)
    assert requires == ["torch", "wrapt"]
    packaged = {f.name for f in distribution.files if f.suffix == ".patch"}
    assert packaged == {p.name for s in patches_by_release().values() for p in s}


HOT_FIX = {"__init__", "_version", "decision_log", "fill", "fill_once", "gating"}
HOT_FIX |= {"installer", "options", "preemption", "prefix_hit", "releases", "switches"}
HOT_FIX |= {"worker_step", "link", "link_handshake", "link_sharing", "link_stats"}
FIDELITY_TOOL = {"__init__", "__main__", "args", "client", "connector", "cores"}
FIDELITY_TOOL |= {"measure", "model", "modes", "picture", "plan", "probe"}
FIDELITY_TOOL |= {"report", "serve", "stats", "summary", "switch", "values"}
FIDELITY_TOOL |= {"wire", "attribution", "node", "node_report", "proxy", "transfers"}
FIDELITY_TOOL |= {"nixl_rest"}


def test_the_wheel_holds_the_hot_fix_its_status_command_and_the_fidelity_tool():
    distribution = installed_distribution()
    modules = {
        str(f.with_suffix("")).removeprefix("vllm_kvfill_patch/")
        for f in distribution.files
        if f.suffix == ".py"
    }
    expected = HOT_FIX | {"__main__"} | {f"fidelity/{m}" for m in FIDELITY_TOOL}
    assert modules == expected


def test_importing_the_package_imports_none_of_its_tools():
    code = (
        "import sys, vllm_kvfill_patch; "
        "print(sorted(m for m in sys.modules if m.startswith('vllm_kvfill_patch')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    printed = ast.literal_eval(done.stdout)
    imported = {m.removeprefix("vllm_kvfill_patch") for m in printed}
    assert imported == {
        "",
        "._version",
        ".decision_log",
        ".gating",
        ".installer",
        ".releases",
        ".switches",
    }


def test_the_wheel_carries_its_license_and_version():
    distribution = installed_distribution()
    licenses = [f for f in distribution.files if f.name == "LICENSE"]
    assert len(licenses) == 1
    assert "Apache License" in licenses[0].read_text()
    assert distribution.metadata["License-Expression"] == "Apache-2.0"
    import vllm_kvfill_patch

    assert vllm_kvfill_patch.__version__ == distribution.version


def test_status_command_names_and_prints_the_patch_from_the_wheel(
    tmp_path, vllm_version
):
    out = status_command(cwd=tmp_path)
    series = patches_by_release()[vllm_version]
    ours = metadata.version("vllm-kvfill-patch")
    assert f"hot-fix:      vllm-kvfill-patch {ours}\n" in out
    assert "decision:     applied" in out
    assert f"defects:      {applied_defects(vllm_version)}\n" in out
    assert f"semantics:    {DECODE_NODE_DEFAULT}\n" in out
    names = ", ".join(p.name for p in series)
    assert f"patches:      {len(series)} for this release, in order: {names}" in out
    printed = subprocess.run(
        [sys.executable, "-m", "vllm_kvfill_patch", "--patch"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        check=True,
    ).stdout
    assert printed == "".join(p.read_text() for p in series)


def test_entry_point_of_the_wheel_patches_a_spawned_child(tmp_path):
    report = run_fresh(children.spawned_child_report, cwd=tmp_path)
    assert report["imported_before_plugins"] is False
    assert report["wrappers"]["DecodeBenchConnector.start_load_kv"] == 1
    assert report["status"]["decision"] == "applied"
    package_file = run_fresh(children.package_location, cwd=tmp_path)["file"]
    assert "site-packages" in package_file
    assert not Path(package_file).is_relative_to(Path(__file__).parent.parent)
    assert os.environ.get("PYTHONPATH", "") == ""


def test_a_plain_copy_of_the_package_imports_without_installed_metadata(tmp_path):
    """As Ray's ``runtime_env`` ``py_modules`` or a PYTHONPATH entry ships it:
    the package's files alone, no distribution metadata to read."""
    import shutil

    copy = tmp_path / "vllm_kvfill_patch"
    installed = Path(run_fresh(children.package_location, cwd=tmp_path)["file"])
    shutil.copytree(installed.parent, copy)
    code = (
        "import importlib.metadata as m\n"
        "def missing(name): raise m.PackageNotFoundError(name)\n"
        "m.version = m.distribution = missing\n"
        "import vllm_kvfill_patch\n"
        "print(vllm_kvfill_patch.__file__, vllm_kvfill_patch.__version__)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    imported, version = done.stdout.split()
    assert Path(imported).is_relative_to(copy)
    assert version == installed_distribution().version
