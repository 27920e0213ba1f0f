"""The ways the tool serves a model: real prefill, a real decode node, and
the connector modes one server switches between (`switch`).

Every connector mode keeps a decode node's semantics (a preempted request is
recomputed), so that they differ in the fill alone; the refill after
preemption and the link model are pairs of their own, each held to its own
ideal (docs/benchmark.md).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, replace

from vllm_kvfill_patch.fidelity.wire import Setting

CONNECTOR = {"kv_connector": "DecodeBenchConnector", "kv_role": "kv_both"}
"""Upstream's connector, as users configure it (`values` serves it)."""
SWITCHED_CONNECTOR = {
    "kv_connector": "SwitchedDecodeBenchConnector",
    "kv_connector_module_path": "vllm_kvfill_patch.fidelity.connector",
    "kv_role": "kv_both",
}
"""The connector the tool's connector server runs (`connector`)."""


def add_fill_config_argument(parser: argparse._ActionsContainer) -> None:
    """`--fill-config`: the connector's fill options, as the tool's commands
    take them."""
    parser.add_argument(
        "--fill-config", default="{}",
        help="the connector's kv_connector_extra_config, JSON (fill_mean, fill_std)",
    )  # fmt: skip


@dataclass(frozen=True)
class Mode:
    name: str
    description: str
    setting: Setting | None
    """None: a server (or pair) of its own without this connector: real
    prefill, or the real decode node."""
    reference: str | None
    """The mode it is held to; None for a reference itself."""
    linked: bool = False
    """Its KV crosses the package's link model, set before its legs from
    what the real node's transfers measured (`node_report.fitted_link`), or from
    ``--link``."""


PREFILL = Mode("prefill", "real prefill, no connector", None, "ideal")
NODE = Mode(
    "decode-node",
    "a real decode node: each prompt's KV read from a prefill server over NIXL",
    None,
    "ideal",
)
UPSTREAM = Mode(
    "upstream", "the connector as released", Setting(False, True, False), "ideal"
)
PACKAGE = Mode(
    "package", "the connector with this package", Setting(True, True, False), "ideal"
)
LINKED = Mode(
    "package+link",
    "the package, each prompt's KV over a link modelled on the real node's",
    Setting(True, True, False),
    "ideal+link",
    linked=True,
)
IDEAL_LINK = Mode(
    "ideal+link",
    "the ideal, each prompt's KV over the same link",
    Setting(True, False, False),
    None,
    linked=True,
)
IDEAL = Mode(
    "ideal",
    "the package's scheduler side, a worker that writes nothing",
    Setting(True, False, False),
    None,
)
REFILL = Mode(
    "package+refill",
    "the package, preempted requests filled again (a decode node with an offload tier)",
    Setting(True, True, True),
    "ideal+refill",
)
IDEAL_REFILL = Mode(
    "ideal+refill",
    "the ideal, preempted requests filled again",
    Setting(True, False, True),
    None,
)
MODES = {
    m.name: m
    for m in (
        PREFILL, NODE, UPSTREAM, PACKAGE, LINKED, IDEAL, IDEAL_LINK, REFILL,
        IDEAL_REFILL,
    )
}  # fmt: skip
"""Every mode, in the table's order."""
DEFAULT_MODES = (PREFILL, NODE, UPSTREAM, PACKAGE, LINKED, IDEAL, IDEAL_LINK)
REFILL_PAIR = (REFILL, IDEAL_REFILL)


def with_link(modes: tuple[Mode, ...], link: tuple[float, float | None]) -> tuple:
    """`modes`, the linked ones set to cross `link` (latency ms, Gb/s)."""
    return tuple(
        replace(mode, setting=replace(mode.setting, link=link))
        if mode.linked and mode.setting is not None
        else mode
        for mode in modes
    )


def with_sharing(modes: tuple[Mode, ...], sharing: str) -> tuple:
    """`modes`, the linked ones sharing their link as `sharing` says."""
    return tuple(
        replace(mode, setting=replace(mode.setting, sharing=sharing))
        if mode.linked and mode.setting is not None
        else mode
        for mode in modes
    )


def serve_arguments(extra_config: dict) -> list[str]:
    """The connector server's `--kv-transfer-config`."""
    config: dict[str, object] = dict(SWITCHED_CONNECTOR)
    if extra_config:
        config["kv_connector_extra_config"] = extra_config
    return ["--kv-transfer-config", json.dumps(config)]
