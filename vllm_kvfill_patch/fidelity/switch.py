"""The connector modes, switched inside each of vLLM's processes.

The probe (`probe`) receives a mode's `wire.Setting` on its control channel
between two legs, while no request runs, and :func:`to` puts it in force:
this package applied or reverted (`apply()` and `revert()` never raise and
may be called between steps), the worker's write on or off
(`connector.SwitchedDecodeBenchConnector`), the refill after preemption and
the link model on or off on each scheduler-side connector. :func:`in_force`
reads back what holds, for the tool to check in every process that has the
connector (a process vLLM starts for something else, a resource tracker, is
left alone).
"""

from __future__ import annotations

import sys
import threading
import weakref
from typing import Any

from vllm_kvfill_patch.fidelity.wire import InForce, Setting
from vllm_kvfill_patch.gating import CONNECTOR_MODULE

REFILL_SOURCE = "the fidelity tool's refill mode"

_lock = threading.Lock()
_writes = True
_connectors: weakref.WeakSet = weakref.WeakSet()


def register(connector: Any) -> None:
    """A connector built in this process (`connector`), to be switched."""
    with _lock:
        _connectors.add(connector)


def writes() -> bool:
    return _writes


def has_connector() -> bool:
    """Whether this process imported the connector (vLLM's API server, engine
    core and workers do, through this package's plugin)."""
    return CONNECTOR_MODULE in sys.modules


def to(setting: Setting) -> None:
    """Put `setting` in force in this process."""
    global _writes
    import vllm_kvfill_patch
    from vllm_kvfill_patch import installer
    from vllm_kvfill_patch.link import LINK_ATTR, MODEL_ATTR, Link, LinkModel
    from vllm_kvfill_patch.link_sharing import Sharing
    from vllm_kvfill_patch.options import REFILL_ATTR

    model = (
        LinkModel(*setting.link, sharing=Sharing(setting.sharing))
        if setting.link and setting.package
        else None
    )
    with _lock:
        if model is None:
            installer.link_opted_out()
        if setting.package:
            vllm_kvfill_patch.apply()
        else:
            vllm_kvfill_patch.revert()
        _writes = setting.writes
        for connector, scheduler in _scheduler_sides():
            setattr(scheduler, REFILL_ATTR, setting.refill)
            link = model and Link.of(
                model, connector._kv_cache_config, connector._vllm_config
            )
            setattr(scheduler, LINK_ATTR, link)
        for connector in _connectors:  # a worker reports its transfers' stats
            if (worker := getattr(connector, "connector_worker", None)) is not None:
                setattr(worker, MODEL_ATTR, model)
        if setting.refill and setting.package and _scheduler_sides():
            installer.refill_opted_in(REFILL_SOURCE)
        if model is not None and _connectors:
            installer.link_opted_in(model)


def in_force() -> InForce:
    """This process's decision, write, refill and link now (refill and link:
    one entry per scheduler-side connector; connectors: how many of each
    role)."""
    import vllm_kvfill_patch
    from vllm_kvfill_patch.link import link_of
    from vllm_kvfill_patch.options import REFILL_ATTR

    with _lock:
        roles = [getattr(getattr(c, "role", None), "name", "?") for c in _connectors]
        schedulers = [scheduler for _, scheduler in _scheduler_sides()]
        links = [link_of(scheduler) for scheduler in schedulers]
        return {
            "decision": vllm_kvfill_patch.status().decision.value,
            "writes": _writes,
            "refill": [getattr(s, REFILL_ATTR, None) for s in schedulers],
            "link": [
                [link.model.latency_ms, link.model.gbps, link.model.sharing.value]
                if link
                else None
                for link in links
            ],
            "connectors": sorted(roles),
        }


def _scheduler_sides() -> list[tuple[Any, Any]]:
    """(connector, its scheduler side) of each scheduler-side connector."""
    found = ((c, getattr(c, "connector_scheduler", None)) for c in _connectors)
    return [(c, scheduler) for c, scheduler in found if scheduler is not None]
