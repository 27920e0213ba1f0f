"""The options part, documented once here: the connector's options are
checked when it is built, and the opt-ins (the refill, the link model) are
read there.

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
    And the refill of preempted requests (``preemption``) and the link model
    (``link``) are options of the connector: they travel with ``vllm
    serve``'s arguments to every process and node, as the fill's own do.

How
    Before upstream's ``__init__``: ``fill_mean`` must be a finite number,
    ``fill_std`` a finite number not below 0, ``refill_preempted`` true or
    false; anything else raises a ``ValueError`` naming the key and the value,
    and the connector is not built (nothing is written). After it: whether
    the refill is in force for this connector (``KVFILL_PATCH_REFILL``, else
    ``refill_preempted``, else off) is kept on its scheduler side for
    ``preemption`` to read, and a refill asked for by the option is reported
    to the installer, through the callback it hands :func:`wrappers`: it
    puts the refill in and says so in the status. ``transfer_latency_ms``
    must be a finite number not below 0 and ``transfer_gbps`` one above 0,
    neither beside ``startup_fill``, and ``transfer_failure_rate`` a finite
    number in [0, 1], above 0 only with the link (its draws seeded by vLLM's
    ``--seed``), ``transfer_sharing`` ``"fifo"`` or ``"fair"``
    (``link_sharing``); where the link is set, the scheduler side gets its
    :class:`~vllm_kvfill_patch.link.Link`, each worker side its model, and
    every role reports the link model to the installer, which puts the link
    part in. A key neither upstream's connector (the keys its module reads)
    nor this package knows is an error where it is a known option misspelt
    (difflib's ratio at least 0.8), naming the option meant; otherwise one
    warning naming it.

Upstream
    No release checks these options; ``refill_preempted``,
    ``transfer_latency_ms``, ``transfer_gbps``, ``transfer_sharing`` and
    ``transfer_failure_rate`` are this package's.

Versions
    Every release the patch applies to: this part goes in with the others.

Remove when
    The rest of the patch goes: upstream then validates (or not) on its own.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm.logger import init_logger

from vllm_kvfill_patch import switches
from vllm_kvfill_patch.gating import CONNECTOR_MODULE
from vllm_kvfill_patch.link import (
    LINK_ATTR,
    MODEL_ATTR,
    Link,
    LinkModel,
    loads_every_group,
)
from vllm_kvfill_patch.link_sharing import Sharing

logger = init_logger("vllm.kvfill_patch")

REFILL_OPTION = "refill_preempted"
REFILL_ATTR = "_kvfill_refill_preempted"
"""On the connector's scheduler side: whether a preempted request is filled
again (``preemption`` reads it)."""
LATENCY_OPTION = "transfer_latency_ms"
BANDWIDTH_OPTION = "transfer_gbps"
FAILURE_OPTION = "transfer_failure_rate"
SHARING_OPTION = "transfer_sharing"
OWN_OPTIONS = (
    REFILL_OPTION,
    LATENCY_OPTION,
    BANDWIDTH_OPTION,
    FAILURE_OPTION,
    SHARING_OPTION,
)
"""The options this package adds to upstream's."""
UPSTREAM_OPTIONS = ("fill_mean", "fill_std")
"""Upstream's options in every release, beside those read from its source."""
NEAR_MISS = 0.8
"""How alike an unknown key and a known option must be (difflib's ratio)
for the key to be taken as that option misspelt: ``transfer_latncy_ms`` is
0.97 from ``transfer_latency_ms``."""


@dataclass(frozen=True)
class OptIns:
    """What a connector's options opt into, once they are all valid."""

    refill: bool = False
    link: LinkModel | None = None


@dataclass(frozen=True)
class Reporters:
    """The installer's callbacks, told what a connector opted into: each puts
    its part in and says so. Handed over when the installer installs this
    part, so that this part never imports the installer back."""

    refill: Callable[[str], None]
    link: Callable[[LinkModel], None]


def wrappers(report: Reporters) -> dict[str, Callable[..., Any]]:
    """The attributes this part wraps, by dotted path in the connector module."""

    def check_options(wrapped: Any, connector: Any, args: tuple, kwargs: dict) -> Any:
        """Wrapper of ``DecodeBenchConnector.__init__``."""
        vllm_config, kv_cache_config = _configs(*args, **kwargs)
        opted = check(extra_config(vllm_config), seed_of(vllm_config))
        result = wrapped(*args, **kwargs)
        refill = refill_in_force(opted.refill)
        scheduler = getattr(connector, "connector_scheduler", None)
        if scheduler is not None:
            setattr(scheduler, REFILL_ATTR, refill)
        if refill:
            report.refill(
                f"{switches.REFILL_SWITCH}=1"
                if switches.refill_switch() is True
                else f"{REFILL_OPTION} in the connector's options"
            )
        if opted.link is not None:
            if scheduler is not None:
                link = _link(opted.link, kv_cache_config, vllm_config)
                setattr(scheduler, LINK_ATTR, link)
            worker = getattr(connector, "connector_worker", None)
            if worker is not None:
                setattr(worker, MODEL_ATTR, opted.link)
            report.link(opted.link)
        return result

    return {"DecodeBenchConnector.__init__": check_options}


def extra_config(vllm_config: Any) -> dict:
    """The connector's ``kv_connector_extra_config`` ({} where there is none)."""
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    options = getattr(transfer, "kv_connector_extra_config", None)
    return options if isinstance(options, dict) else {}


def seed_of(vllm_config: Any) -> int:
    """vLLM's own seed (``--seed``; 0 where unset): the failed transfers of
    two runs with one seed are the same."""
    seed = getattr(getattr(vllm_config, "model_config", None), "seed", None)
    return seed if isinstance(seed, int) else 0


def check(options: dict, seed: int = 0) -> OptIns:
    """What the options opt into, once every option this package knows is
    valid; raises ValueError naming the first that is not, or a key that is
    a known option misspelt. `seed` draws the failed transfers."""
    check_keys(options)
    for key in (
        "fill_mean",
        "fill_std",
        LATENCY_OPTION,
        BANDWIDTH_OPTION,
        FAILURE_OPTION,
    ):
        if key in options:
            _require(
                key, options[key], _is_finite_number(options[key]), "a finite number"
            )
    for key in ("fill_std", LATENCY_OPTION):
        if key in options and options[key] < 0:
            _require(key, options[key], False, "at least 0")
    if BANDWIDTH_OPTION in options and options[BANDWIDTH_OPTION] <= 0:
        _require(BANDWIDTH_OPTION, options[BANDWIDTH_OPTION], False, "above 0")
    failure_rate = options.get(FAILURE_OPTION, 0.0)
    _require(FAILURE_OPTION, failure_rate, 0 <= failure_rate <= 1, "within [0, 1]")
    refill = options.get(REFILL_OPTION, False)
    _require(REFILL_OPTION, refill, isinstance(refill, bool), "true or false")
    sharing = options.get(SHARING_OPTION, Sharing.FIFO.value)
    names = [mode.value for mode in Sharing]
    _require(SHARING_OPTION, sharing, sharing in names, " or ".join(map(repr, names)))
    if LATENCY_OPTION not in options and BANDWIDTH_OPTION not in options:
        _require(
            FAILURE_OPTION,
            failure_rate,
            failure_rate == 0,
            f"0 unless {LATENCY_OPTION} or {BANDWIDTH_OPTION} is set (only a "
            "transfer over the link can fail)",
        )
        return OptIns(refill)
    _require(
        "startup_fill",
        options.get("startup_fill", False),
        not options.get("startup_fill", False),
        f"false where {LATENCY_OPTION} or {BANDWIDTH_OPTION} is set (a group "
        "filled at startup has no KV to carry)",
    )
    link = LinkModel(
        options.get(LATENCY_OPTION, 0.0),
        options.get(BANDWIDTH_OPTION),
        failure_rate,
        seed,
        Sharing(sharing),
    )
    return OptIns(refill, link)


def check_keys(options: dict) -> None:
    """A key neither upstream's connector nor this package knows: an error
    where it is a known option misspelt, naming the option meant; otherwise
    one warning naming it (it may be meant for another connector)."""
    known = known_options()
    for key in options:
        if key in known:
            continue
        meant = difflib.get_close_matches(str(key), known, n=1, cutoff=NEAR_MISS)
        if meant:
            raise ValueError(
                f"DecodeBenchConnector: kv_connector_extra_config {key!r} is not "
                f"an option; did you mean {meant[0]!r}?"
            )
        logger.warning_once(
            "vllm-kvfill-patch: kv_connector_extra_config %r is not an option "
            "of DecodeBenchConnector (its options: %s): ignored",
            key,
            ", ".join(known),
        )


@functools.cache
def known_options() -> tuple[str, ...]:
    """Upstream's options (the keys its connector module reads from its
    extra config, as its source says) and this package's."""
    module = sys.modules.get(CONNECTOR_MODULE)
    try:
        source = inspect.getsource(module) if module is not None else ""
    except (OSError, TypeError):  # no source shipped: the options every release has
        source = ""
    read = re.findall(r"""get(?:_from_extra_config)?\(\s*["'](\w+)["']""", source)
    return tuple(dict.fromkeys((*UPSTREAM_OPTIONS, *sorted(read), *OWN_OPTIONS)))


def _link(model: LinkModel, kv_cache_config: Any, vllm_config: Any) -> Link:
    """The scheduler side's link; a bandwidth needs the KV-cache config, to
    know the bytes a transfer carries."""
    if kv_cache_config is None:
        _require(
            BANDWIDTH_OPTION,
            model.gbps,
            model.gbps is None,
            f"unset: this vLLM does not give the connector its KV-cache config, "
            f"so a transfer's bytes are unknown ({LATENCY_OPTION} alone works)",
        )
        return Link(model, ())
    groups = len(kv_cache_config.kv_cache_groups)
    if groups > 1 and not loads_every_group():
        raise ValueError(
            f"DecodeBenchConnector: kv_connector_extra_config {LATENCY_OPTION!r} "
            f"and {BANDWIDTH_OPTION!r} need a vLLM whose scheduler finishes "
            f"async loads of every KV-cache group (0.21 does); this one "
            f"finishes one group's only, and this model has {groups}"
        )
    if model.failure_rate and groups > 1 and not fails_by_request():
        raise ValueError(
            f"DecodeBenchConnector: kv_connector_extra_config {FAILURE_OPTION!r} "
            "needs a vLLM that takes a failed load by request (0.32 does) for a "
            f"model of several KV-cache groups; this one takes failed blocks of "
            f"one group only, and this model has {groups}"
        )
    return Link.of(model, kv_cache_config, vllm_config)


def fails_by_request() -> bool:
    """Whether vLLM's workers report a failed load by request
    (``KVConnectorOutput.failed_recving``, 0.32+): the one way it fails a
    load of a model with several KV-cache groups."""
    from vllm.v1.outputs import KVConnectorOutput

    return "failed_recving" in getattr(KVConnectorOutput, "__dataclass_fields__", {})


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


def _configs(
    vllm_config: Any, role: Any = None, kv_cache_config: Any = None
) -> tuple[Any, Any]:
    """The vLLM config and the KV-cache config, however they were passed."""
    return vllm_config, kv_cache_config
