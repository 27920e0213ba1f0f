"""``tools/gpu_check.py`` run on a fill that writes one row too many.

    python tests/gpu_check_mutant.py [gpu_check's arguments]

Every fill, on every path, also writes the null block's rows (block 0, which
no request owns): the check must say so on every path and exit 1
(``tests/test_gpu_check.py``). The mutant is the package's own id sorting,
which every path goes through (a group's pages at once and layer by layer),
so the CPU's replay makes the same mistake: only the model of what a step
must write can find it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

GPU_CHECK = Path(__file__).parents[1] / "tools" / "gpu_check.py"


def main(argv: list[str]) -> int:
    spec = importlib.util.spec_from_file_location("gpu_check", GPU_CHECK)
    assert spec is not None and spec.loader is not None
    gpu_check = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = gpu_check  # its dataclasses look it up
    spec.loader.exec_module(gpu_check)
    fill = gpu_check.fill()
    original = fill.sort_block_ids

    def one_row_too_many(block_ids, num_blocks):  # type: ignore[no-untyped-def]
        ids, outside = original(block_ids, num_blocks)
        return ([fill.NULL_BLOCK_ID, *ids] if ids else ids), outside

    fill.sort_block_ids = one_row_too_many
    return int(gpu_check.main(argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
