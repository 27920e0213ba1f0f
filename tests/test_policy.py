"""The support policy is stated three times; this keeps them in step:
gating.SUPPORT_POLICY (the code), README.md's table, noxfile.py's RELEASES."""

from __future__ import annotations

import re
from pathlib import Path

import noxfile
from vllm_kvfill_patch.gating import SUPPORT_POLICY, Decision, parse_release, policy_for

README = Path(__file__).resolve().parent.parent / "README.md"

PUBLISHED = (
    "0.11.0 0.11.1 0.11.2 0.12.0 0.13.0 0.14.0 0.14.1 0.15.0 0.15.1 0.16.0 0.17.0 "
    "0.17.1 0.18.0 0.18.1 0.19.0 0.19.1 0.20.0 0.20.1 0.20.2 0.21.0 0.22.0 0.22.1 "
    "0.23.0 0.24.0 0.25.0 0.25.1 0.26.0 0.27.0 0.27.1 0.28.0 0.29.0 0.30.0 0.31.0 "
    "0.32.0 0.33.0"
).split()
"""vLLM releases from 0.11.0 to 0.33.0, as PyPI lists them."""

ROW = re.compile(r"^\| (\d+\.\d+\.\d+) \| (\w+) \| (.+?) \|$", re.MULTILINE)


def readme_rows() -> dict[str, tuple[str, str]]:
    return {m[1]: (m[2], m[3]) for m in ROW.finditer(README.read_text())}


def test_policy_ranges_are_contiguous_and_cover_everything():
    assert SUPPORT_POLICY[0].first == (0, 0, 0) and SUPPORT_POLICY[-1].end is None
    for before, after in zip(SUPPORT_POLICY, SUPPORT_POLICY[1:], strict=False):
        assert before.end == after.first


def test_readme_table_lists_every_release_with_the_policys_decision():
    rows = readme_rows()
    assert list(rows) == PUBLISHED
    for release, (decision, _) in rows.items():
        assert decision == policy_for(release).decision.value, release


def test_readme_marks_exactly_the_nox_matrix_as_tested():
    rows = readme_rows()
    tested = {r for r, (_, status) in rows.items() if status.startswith("tested")}
    assert tested == set(noxfile.RELEASES)
    for release, (_, status) in rows.items():
        assert status.startswith(("tested", "not tested here: ")), release


def test_nox_matrix_expects_the_policys_decisions():
    for release, decision in noxfile.RELEASES.items():
        assert Decision(decision) is policy_for(release).decision, release


def test_matrix_has_a_release_per_connector_variant():
    variants = {"0.11.0", "0.11.1", "0.12.0", "0.14.0", "0.16.0", "0.21.0", "0.23.0"}
    variants |= {"0.24.0", "0.26.0", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.33.0"}
    assert variants <= set(noxfile.RELEASES)


def test_unparseable_versions_have_no_policy():
    assert parse_release("main") is None and policy_for("main") is None
