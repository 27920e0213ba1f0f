"""`python -m vllm_kvfill_patch`: the patch's decision for the installed vLLM."""

from __future__ import annotations

from pathlib import Path

from vllm_kvfill_patch import load_vllm_plugin, status

PATCHES_DIR = Path(__file__).resolve().parent.parent / "patches"


def main() -> None:
    load_vllm_plugin()
    current = status()
    print(f"vLLM version: {current.vllm_version or 'not installed'}")
    print(f"decision:     {current.decision.value}")
    print(f"reason:       {current.reason}")
    patches = sorted(PATCHES_DIR.glob("*.patch")) if PATCHES_DIR.is_dir() else []
    print(
        "patch files:  "
        + (", ".join(map(str, patches)) or "in the source tree's patches/")
    )


if __name__ == "__main__":
    main()
