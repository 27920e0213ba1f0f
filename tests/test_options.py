"""The connector's options are checked when it is built; the refill's option
sets the semantics of its scheduler side and says so.

Real DecodeBenchConnectors of the installed release, in both roles, built
from real VllmConfigs whose ``kv_connector_extra_config`` is the one under
test.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from tests.helpers import applied_defects, opt_ins_forgotten, overlay_reverted
from tests.hybrid import (
    BLOCK_SIZE,
    make_pool,
    make_worker_connector,
    scheduler_connector,
    start_fill,
)

BAD_OPTIONS = {
    "nan mean": ({"fill_mean": math.nan}, "'fill_mean' must be a finite number"),
    "infinite mean": ({"fill_mean": math.inf}, "'fill_mean' must be a finite number"),
    "text mean": ({"fill_mean": "abc"}, "'fill_mean' must be a finite number"),
    "boolean mean": ({"fill_mean": True}, "'fill_mean' must be a finite number"),
    "negative spread": ({"fill_std": -1}, "'fill_std' must be at least 0"),
    "nan spread": ({"fill_std": math.nan}, "'fill_std' must be a finite number"),
    "text spread": ({"fill_std": "0.02"}, "'fill_std' must be a finite number"),
    "text refill": ({"refill_preempted": "yes"}, "'refill_preempted' must be true"),
    "numeric refill": ({"refill_preempted": 1}, "'refill_preempted' must be true"),
}
"""Options a user may write, and what the error says."""


def build(role: str, config):
    """A real connector of `role` from `config` (the worker with a pool's
    caches registered)."""
    if role == "scheduler":
        return scheduler_connector(config, [BLOCK_SIZE])
    pool = make_pool(16)
    return make_worker_connector(config, pool), pool


@pytest.mark.parametrize("role", ["scheduler", "worker"])
@pytest.mark.parametrize("case", BAD_OPTIONS)
def test_a_bad_option_is_an_error_at_construction_naming_it(
    case, role, vllm_config_for
):
    options, said = BAD_OPTIONS[case]
    config = vllm_config_for(**options)
    value = next(iter(options.values()))
    with pytest.raises(
        ValueError, match=re.escape(said) + ".* got " + re.escape(repr(value))
    ):
        build(role, config)


def test_upstream_builds_a_nan_mean_and_writes_nan_into_the_rows(
    vllm_config_for, vllm_version
):
    """What the check prevents: upstream takes NaN at construction and writes
    it into the attention rows its fill reaches."""
    from vllm_kvfill_patch.releases import policy_for

    if "crashes" in policy_for(vllm_version).defects:
        pytest.skip(
            "upstream's fill on 0.11.1 - 0.23 crashes on the pool's list states "
            "before it writes a row: NaN reaches no cache there"
        )
    with overlay_reverted():
        connector, pool = build("worker", vllm_config_for(fill_mean=math.nan))
        cache = next(iter(pool.caches.values()))
        before = torch.isnan(cache.float()).sum().item()
        start_fill(connector, {"r": (([3],), BLOCK_SIZE)})
        assert torch.isnan(cache.float()).sum().item() > before


@pytest.mark.parametrize(
    "options", [{"fill_mean": 0, "fill_std": 0.02}, {"refill_preempted": False}]
)
def test_good_options_build_a_connector(options, vllm_config_for):
    import vllm_kvfill_patch
    from vllm_kvfill_patch import Decision
    from vllm_kvfill_patch.options import REFILL_ATTR

    config = vllm_config_for(**options)
    scheduler = build("scheduler", config)
    worker, _ = build("worker", config)
    # Checked and passed on: the refill off on the scheduler side, the fill's
    # values upstream's worker took.
    assert getattr(scheduler.connector_scheduler, REFILL_ATTR) is False
    assert worker.connector_worker.fill_mean == options.get("fill_mean", 0.015)
    assert worker.connector_worker.fill_std == options.get("fill_std", 0.0)
    status = vllm_kvfill_patch.status()
    assert status.decision is Decision.APPLIED
    assert "options" in status.parts and "refill" not in status.parts


def test_the_refill_option_puts_the_refill_in_and_says_so(
    vllm_config_for, vllm_log, vllm_version
):
    import vllm_kvfill_patch

    default = scheduler_connector(vllm_config_for(), [BLOCK_SIZE])
    assert "refill" not in vllm_kvfill_patch.status().parts
    assert default.connector_scheduler._kvfill_refill_preempted is False
    with opt_ins_forgotten():
        config = vllm_config_for(refill_preempted=True)
        connector = scheduler_connector(config, [BLOCK_SIZE])
        assert connector.connector_scheduler._kvfill_refill_preempted is True
        status = vllm_kvfill_patch.status()
        assert status.parts[-1] == "refill"
        assert status.semantics == (
            "a decode node with an offload tier: a preempted request filled again"
        )
        assert status.semantics_why == "refill_preempted in the connector's options"
        assert status.defects == applied_defects(vllm_version)
        assert status.reason.endswith(
            "; semantics: a decode node with an offload tier: a preempted request "
            "filled again (refill_preempted in the connector's options)"
        )
        lines = [r.getMessage() for r in vllm_log if "offload tier" in r.getMessage()]
        assert len(lines) == 1 and "[parts: " in lines[0]
        # A second connector asking for it changes nothing more.
        scheduler_connector(config, [BLOCK_SIZE])
        assert vllm_kvfill_patch.status() == status
    assert "refill" not in vllm_kvfill_patch.status().parts


def test_the_switch_off_overrules_the_option_and_says_so_once(
    vllm_config_for, vllm_log, monkeypatch
):
    import vllm_kvfill_patch

    monkeypatch.setenv("KVFILL_PATCH_REFILL", "0")
    config = vllm_config_for(refill_preempted=True)
    with opt_ins_forgotten():
        for _ in range(2):
            connector = scheduler_connector(config, [BLOCK_SIZE])
            assert connector.connector_scheduler._kvfill_refill_preempted is False
        assert "refill" not in vllm_kvfill_patch.status().parts
    said = [r for r in vllm_log if "true in the connector's options" in r.getMessage()]
    assert len(said) == 1


MISSPELT = {
    "latency": ("transfer_latncy_ms", "transfer_latency_ms"),
    "bandwidth": ("transfer_gpbs", "transfer_gbps"),
    "failure rate": ("transfer_failure_rat", "transfer_failure_rate"),
    "upstream's mean": ("fill_maen", "fill_mean"),
}


@pytest.mark.parametrize("role", ["scheduler", "worker"])
@pytest.mark.parametrize("case", MISSPELT)
def test_a_misspelt_option_is_an_error_naming_the_option_meant(
    case, role, vllm_config_for
):
    key, meant = MISSPELT[case]
    with pytest.raises(
        ValueError, match=rf"'{key}' is not an option; did you mean '{meant}'\?"
    ):
        build(role, vllm_config_for(**{key: 200}))


@pytest.mark.parametrize(
    "value",
    [1.5, -0.1, math.nan, "0.5", True],
    ids=["1.5", "-0.1", "nan", "text", "true"],
)
def test_a_failure_rate_outside_zero_to_one_is_an_error(value, vllm_config_for):
    config = vllm_config_for(transfer_latency_ms=5, transfer_failure_rate=value)
    with pytest.raises(ValueError, match=r"'transfer_failure_rate' must be"):
        build("scheduler", config)


def test_a_failure_rate_without_the_link_is_an_error(vllm_config_for):
    with pytest.raises(
        ValueError, match=r"'transfer_failure_rate' must be 0 unless transfer_latency"
    ):
        build("scheduler", vllm_config_for(transfer_failure_rate=0.1))


def test_an_unknown_key_is_one_warning_naming_it(vllm_config_for, vllm_log):
    """A key of no option of the connector (here NIXL's lease, in a config
    shared between servers) builds the connector, with one warning."""
    config = vllm_config_for(kv_lease_duration=900, fill_mean=0.0)
    for role in ("scheduler", "worker", "scheduler"):
        build(role, config)
    said = [r.getMessage() for r in vllm_log if "'kv_lease_duration'" in r.getMessage()]
    assert len(said) == 1
    assert "is not an option of DecodeBenchConnector" in said[0]
    assert "transfer_failure_rate" in said[0] and "fill_mean" in said[0]
