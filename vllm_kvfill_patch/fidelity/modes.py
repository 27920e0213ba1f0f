"""The ways the tool serves a model: what each mode is and how it is started."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field

CONNECTOR = {"kv_connector": "DecodeBenchConnector", "kv_role": "kv_both"}
NO_WRITE_CONNECTOR = {
    "kv_connector": "NoWriteDecodeBenchConnector",
    "kv_connector_module_path": "vllm_kvfill_patch.fidelity.ideal",
    "kv_role": "kv_both",
}


def add_fill_config_argument(parser: argparse.ArgumentParser) -> None:
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
    connector: dict | None
    decision: str
    """What this package's decision line says in the mode's processes."""
    env: dict[str, str] = field(default_factory=dict)

    def serve_arguments(self, extra_config: dict) -> list[str]:
        if self.connector is None:
            return []
        config = dict(self.connector)
        if extra_config:
            config["kv_connector_extra_config"] = extra_config
        return ["--kv-transfer-config", json.dumps(config)]


MODES = {
    mode.name: mode
    for mode in (
        Mode(
            "prefill",
            "real prefill, no connector, vLLM alone",
            None,
            "disabled",
            {"KVFILL_PATCH_DISABLE": "1"},
        ),
        Mode(
            "upstream",
            "the connector as released (KVFILL_PATCH_DISABLE=1)",
            CONNECTOR,
            "disabled",
            {"KVFILL_PATCH_DISABLE": "1"},
        ),
        Mode("package", "the connector with this package", CONNECTOR, "applied"),
        Mode(
            "ideal",
            "upstream's scheduler side, with the package's corrections, "
            "and a worker that writes nothing",
            NO_WRITE_CONNECTOR,
            "applied",
        ),
    )
}
"""Every mode, in the table's order; `ideal` is what the others are held to."""
IDEAL = "ideal"
PACKAGE = "package"
