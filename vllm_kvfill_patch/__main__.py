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
    for_release = [p for p in patches if p.stem.endswith(f"-v{current.vllm_version}")]
    if for_release:
        print(f"patch file:   {for_release[0]} (for this release)")
    elif patches:
        print(f"patch files:  {', '.join(map(str, patches))}")
    else:
        print("patch files:  patches/ of the source distribution")


if __name__ == "__main__":
    main()
