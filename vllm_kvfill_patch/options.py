"""The options part, documented once here: the connector's options are
checked when it is built, and the refill's opt-in is read there.

Target
    ``vllm.distributed.kv_transfer.kv_connector.v1.decode_bench_connector``:
    ``DecodeBenchConnector.__init__`` is wrapped by ``check_options``,
    in every role (the scheduler's and each worker's connector).

Why
    Upstream reads ``fill_mean`` and ``fill_std`` from
    ``kv_connector_extra_config`` without a check: ``NaN`` is written into the
    requested rows, a string passes construction and raises a ``TypeError``
    inside the first fill, in a worker, and a negative spread is silently a
    constant fill. A benchmark's bad option is an error at start, naming it.
    And the refill of preempted requests (``preemption``) is an option of the
    connector: it travels with ``vllm serve``'s arguments to every process
    and node, as the fill's own options do.

How
    Before upstream's ``__init__``: ``fill_mean`` must be a finite number,
    ``fill_std`` a finite number not below 0, ``refill_preempted`` true or
    false; anything else raises a ``ValueError`` naming the key and the value,
    and the connector is not built (nothing is written). After it: whether
    the refill is in force for this connector (``KVFILL_PATCH_REFILL``, else
    ``refill_preempted``, else off) is kept on its scheduler side for
    ``preemption`` to read, and a refill asked for by the option is reported
    to the installer, through the callback it hands :func:`wrappers`: it
    puts the refill in and says so in the status.

Upstream
    No release checks these options; ``refill_preempted`` is this package's.

Versions
    Every release the patch applies to: this part goes in with the others.

Remove when
    The rest of the patch goes: upstream then validates (or not) on its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from vllm.logger import init_logger

from vllm_kvfill_patch import switches

logger = init_logger("vllm.kvfill_patch")

REFILL_OPTION = "refill_preempted"
REFILL_ATTR = "_kvfill_refill_preempted"
"""On the connector's scheduler side: whether a preempted request is filled
again (``preemption`` reads it)."""


def wrappers(report_refill: Callable[[str], None]) -> dict[str, Callable[..., Any]]:
    """The attributes this part wraps, by dotted path in the connector module.

    `report_refill` is the installer's: told what asked for the refill, it
    puts the refill in and says so. The installer hands it over when it
    installs this part, so that this part never imports the installer back.
    """

    def check_options(wrapped: Any, connector: Any, args: tuple, kwargs: dict) -> Any:
        """Wrapper of ``DecodeBenchConnector.__init__``."""
        vllm_config = _vllm_config(*args, **kwargs)
        refill_option = check(extra_config(vllm_config))
        result = wrapped(*args, **kwargs)
        refill = refill_in_force(refill_option)
        scheduler = getattr(connector, "connector_scheduler", None)
        if scheduler is not None:
            setattr(scheduler, REFILL_ATTR, refill)
        if refill:
            report_refill(
                f"{switches.REFILL_SWITCH}=1"
                if switches.refill_switch() is True
                else f"{REFILL_OPTION} in the connector's options"
            )
        return result

    return {"DecodeBenchConnector.__init__": check_options}


def extra_config(vllm_config: Any) -> dict:
    """The connector's ``kv_connector_extra_config`` ({} where there is none)."""
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    options = getattr(transfer, "kv_connector_extra_config", None)
    return options if isinstance(options, dict) else {}


def check(options: dict) -> bool:
    """The refill option, once every option this package knows is valid;
    raises ValueError naming the first that is not."""
    for key in ("fill_mean", "fill_std"):
        if key in options:
            _require(
                key, options[key], _is_finite_number(options[key]), "a finite number"
            )
    if "fill_std" in options and options["fill_std"] < 0:
        _require("fill_std", options["fill_std"], False, "at least 0")
    refill = options.get(REFILL_OPTION, False)
    _require(REFILL_OPTION, refill, isinstance(refill, bool), "true or false")
    return refill


def refill_in_force(refill_option: bool) -> bool:
    """The switch where it is set, else the connector's option. A switch
    that overrules the option is said once."""
    switch = switches.refill_switch()
    if switch is None:
        return refill_option
    if switch is False and refill_option:
        logger.warning_once(
            "vllm-kvfill-patch: %s is true in the connector's options but %s=0: "
            "a preempted request is recomputed, not filled again",
            REFILL_OPTION,
            switches.REFILL_SWITCH,
        )
    return switch


def _require(key: str, value: Any, valid: bool, rule: str) -> None:
    if not valid:
        raise ValueError(
            f"DecodeBenchConnector: kv_connector_extra_config {key!r} must be "
            f"{rule}, got {value!r} ({type(value).__name__})"
        )


def _is_finite_number(value: Any) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
    )


def _vllm_config(vllm_config: Any, *args: Any, **kwargs: Any) -> Any:
    return vllm_config
