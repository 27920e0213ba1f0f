"""Every relative link in the project's Markdown resolves: its file exists and,
where it names a section (``#...``), the file has that heading.

    python tools/check_links.py          # exit 1, listing each broken link

Run by the ``lint`` session. Anchors are GitHub's: a heading lowercased, its
punctuation dropped and its spaces made hyphens.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*$", re.MULTILINE)
CODE = re.compile(r"^(```|    ).*$", re.MULTILINE)


def anchor(heading: str) -> str:
    text = re.sub(r"[`*_]", "", heading).strip().lower()
    return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", text))


def anchors(path: Path) -> set[str]:
    return {anchor(h) for h in HEADING.findall(CODE.sub("", path.read_text()))}


def broken_links(page: Path) -> list[str]:
    found = []
    for target in LINK.findall(CODE.sub("", page.read_text())):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        file_part, _, section = target.partition("#")
        linked = (page.parent / file_part).resolve() if file_part else page
        if not linked.exists():
            found.append(f"{page.relative_to(ROOT)}: {target}: no such file")
        elif section and linked.suffix == ".md" and section not in anchors(linked):
            found.append(f"{page.relative_to(ROOT)}: {target}: no such section")
    return found


def main() -> int:
    tracked = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.md"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    broken = [line for name in tracked for line in broken_links(ROOT / name)]
    print("\n".join(broken) or f"{len(tracked)} pages: every relative link resolves")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
