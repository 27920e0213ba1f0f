"""vLLM's own `vllm bench serve`, as the tool runs it, and its figures.

A leg is one run of vLLM's client (its code, in this process); a round's
figures are vLLM's own formulas over its legs' requests (`combined`). A leg
whose figures are not the server's (requests lost, or read in bursts by a
client kept off the CPU) is taken again (`rerun_reason`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from vllm_kvfill_patch.fidelity.wire import REQUEST_LISTS

SLIM_KEYS = (
    "ttfts", "latencies", "output_lens", "itls", "start_times", "steps",
    *REQUEST_LISTS,
)  # fmt: skip
"""The lists of a leg a cell keeps: vLLM's per-request lists (`combined` and
the comparison with the ideal read them), the worker's steps over the leg
(`attribution`) and what its requests recorded in the scheduler
(`node_report`); the rest stay in vLLM's file."""
REQUEST_ID_PREFIX = "kvfill-"
"""What vLLM's client names a leg's requests by, before each one's index
(``--request-id-prefix``): the proxy passes the name on (``X-Request-Id``)
and vLLM keeps it in its own request id, so that what the engine recorded
of a request pairs with what the client did (`ways_in_and_out`)."""
ENGINE_REQUEST = re.compile(re.escape(REQUEST_ID_PREFIX) + r"(\d+)(?:-|$)")
"""The client's index of a request, in the id vLLM gave it (``cmpl-``, the
client's name, a random suffix)."""


WARM_UP_TOKENS = 4
"""Output tokens of a warm-up request: its prompt's way in, its KV's arrival
and a few decode steps, not a leg's worth."""


@dataclass(frozen=True)
class Workload:
    """What every leg asks of a server: the random dataset's lengths, with
    `--ignore-eos`, the user's own options for `vllm bench serve`, and the
    requests that warm the server up before each leg (`warm_up`)."""

    model: str
    tokenizer: str
    input_len: int
    output_len: int
    extra: list[str] = field(default_factory=list)
    warm_ups: int = 0


def bench(
    base_url: str,
    workload: Workload,
    concurrency: int,
    prompts: int,
    seed: int,
    result: Path,
) -> dict:
    """One run of vLLM's own `vllm bench serve` against the server at
    `base_url` (its code, in this process: a new interpreter would import
    vLLM again every run); its result JSON (with each request's timings and
    error), also left at `result`, its output beside it, with
    ``wall_clock_offset``: the wall clock less the client's clock
    (`time.perf_counter`, its ``start_times``)."""
    from vllm.benchmarks.serve import add_cli_args, main

    arguments = [
        "--backend", "vllm", "--base-url", base_url,
        "--model", workload.model, "--tokenizer", workload.tokenizer,
        "--dataset-name", "random", "--random-input-len", str(workload.input_len),
        "--random-output-len", str(workload.output_len), "--ignore-eos",
        "--num-prompts", str(prompts), "--max-concurrency", str(concurrency),
        "--request-rate", "inf", "--seed", str(seed), "--disable-tqdm",
        "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
        "--request-id-prefix", REQUEST_ID_PREFIX,
        "--save-result", "--save-detailed", "--result-dir", str(result.parent),
        "--result-filename", result.name, *workload.extra,
    ]  # fmt: skip
    parser = argparse.ArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    log = result.with_suffix(".log")
    offset = time.time() - time.perf_counter()
    with log.open("w") as out, contextlib.redirect_stdout(out):
        try:
            main(parser.parse_args(arguments))
        except Exception as error:  # a cell of the table says it
            raise RuntimeError(
                f"vllm bench serve failed: {type(error).__name__}: {error}"
            ) from error
    return json.loads(result.read_text()) | {"wall_clock_offset": offset}


def warm_up(base_url: str, workload: Workload, seed: int, result: Path) -> None:
    """`workload.warm_ups` requests, one at a time, of prompts no leg sends
    (`seed`), `WARM_UP_TOKENS` tokens each, not measured: a leg then starts
    on a server that has just served, as each request after a leg's first
    does, not one the tool has just switched or left idle. Raises
    RuntimeError where one failed."""
    if workload.warm_ups <= 0:
        return
    short = replace(workload, output_len=WARM_UP_TOKENS)
    figures = bench(base_url, short, 1, workload.warm_ups, seed, result)
    if failure := failed_requests(figures):
        raise RuntimeError(f"the warm-up before the leg: {failure}")


def failed_requests(figures: dict) -> str | None:
    """How many of a run's requests failed and the client's first error, or
    None when every one completed."""
    failed = figures["num_prompts"] - figures["completed"]
    if not failed:
        return None
    why = client_error(figures) or "vLLM's client gave no reason"
    return f"{failed} of {figures['num_prompts']} requests failed: {why}"


def rerun_reason(figures: dict) -> str | None:
    """Why a run of `vllm bench serve` is taken again, or None."""
    if failure := failed_requests(figures):
        return failure
    bursts = read_in_bursts(figures)
    if bursts:
        return (
            f"vLLM's client read {bursts} requests' tokens in bursts (it or the "
            "API server was kept off the CPU)"
        )
    return None


def slim(result: dict) -> dict:
    """A leg's result with its scalars and `SLIM_KEYS` only."""
    return {
        key: value
        for key, value in result.items()
        if key in SLIM_KEYS or not isinstance(value, list)
    }


BURST_SECONDS = 1e-4
"""Two streamed chunks of a request that vLLM's client timed this close were
read at once: they had waited for it in a buffer."""


def read_in_bursts(result: dict) -> int:
    """Requests of a `vllm bench serve` result (saved with `--save-detailed`)
    whose tokens its client read mostly in bursts: over half their
    inter-token latencies under `BURST_SECONDS`. Their TPOT and ITL are not
    the server's (a whole output read at once times as TPOT 0): the client
    or the API server was kept off the CPU while the engine went on. On two
    cores this happens: vLLM's engine core spin-waits on its worker."""
    return sum(
        1
        for itls in result.get("itls", [])
        if itls and 2 * sum(itl < BURST_SECONDS for itl in itls) > len(itls)
    )


def client_error(result: dict) -> str | None:
    """The exception vLLM's client ended its first failed request with (the
    last line of its traceback), from a result saved with `--save-detailed`."""
    for error in result.get("errors", []):
        if error and error.strip():
            return error.strip().splitlines()[-1]
    return None


PERCENTILE_KEY = re.compile(r"p(\d+(?:\.\d+)?)_(ttft|tpot|itl)_ms")
"""How vLLM's result names a percentile of a metric: `p99_itl_ms`."""


def request_seconds(result: dict) -> dict[str, list[float]]:
    """A run's samples of each metric vLLM takes percentiles of, in seconds,
    as `calculate_metrics` in vllm/benchmarks/serve.py takes them: a TTFT per
    request, a TPOT per request of more than one output token, every ITL;
    and, where the probe recorded them, the engine's (`engine_ttft`: from
    the request's arrival at the server to the engine's first token)."""
    seconds: dict[str, list[float]] = {"ttft": [], "tpot": [], "itl": []}
    if result.get("first_tokens"):
        seconds["engine_ttft"] = [
            first - arrival for _, arrival, first in result["first_tokens"]
        ]
    for ttft, latency, length, itls in zip(
        result["ttfts"], result["latencies"], result["output_lens"],
        result["itls"], strict=True,
    ):  # fmt: skip
        seconds["ttft"].append(ttft)
        seconds["itl"] += itls
        if length > 1:
            seconds["tpot"].append((latency - ttft) / (length - 1))
    return seconds


def ways_in_and_out(result: dict) -> list[tuple[float, float]]:
    """Each request of a leg the engine recorded (the probe's
    ``first_tokens``), paired with the client's by its name: its way in
    (sent by vLLM's client to its arrival at the server, vLLM's
    ``arrival_time``) and its way out (the engine's first token for it to the
    client's), in seconds. Both are on the wall clock (``wall_clock_offset``);
    their sum with the engine's TTFT is the client's TTFT."""
    offset = result.get("wall_clock_offset")
    if offset is None:
        return []
    sent = [
        (start + offset, start + ttft + offset)
        for start, ttft in zip(result["start_times"], result["ttfts"], strict=True)
    ]
    ways = []
    for request_id, arrival, first in result.get("first_tokens", []):
        if (named := ENGINE_REQUEST.search(request_id)) and int(named[1]) < len(sent):
            start, received = sent[int(named[1])]
            ways.append((arrival - start, received - first))
    return ways


def combined(results: list[dict]) -> dict:
    """The figures of runs of `vllm bench serve` (saved with
    `--save-detailed`, every request completed) taken as one run: vLLM's
    own formulas (`calculate_metrics` in vllm/benchmarks/serve.py) over all
    their requests, their durations added; the lists stay in vLLM's files.
    For one run, its own figures again (to float rounding)."""
    import numpy as np

    figures = {k: v for k, v in results[0].items() if not isinstance(v, list)}
    for key in (
        "num_prompts", "completed", "failed", "duration",
        "total_input_tokens", "total_output_tokens",
    ):  # fmt: skip
        figures[key] = sum(result[key] for result in results)
    for key in ("max_output_tokens_per_s", "max_concurrent_requests"):
        figures[key] = max(result[key] for result in results)
    duration = figures["duration"]
    tokens = figures["total_input_tokens"] + figures["total_output_tokens"]
    figures.update(
        request_throughput=figures["completed"] / duration,
        output_throughput=figures["total_output_tokens"] / duration,
        total_token_throughput=tokens / duration,
    )
    seconds: dict[str, list[float]] = {"ttft": [], "tpot": [], "itl": []}
    for result in results:
        for metric, values in request_seconds(result).items():
            seconds.setdefault(metric, []).extend(values)
    for metric, values in seconds.items():
        taken = values or [0.0]
        figures[f"mean_{metric}_ms"] = float(np.mean(taken)) * 1000
        figures[f"median_{metric}_ms"] = float(np.median(taken)) * 1000
        figures[f"std_{metric}_ms"] = float(np.std(taken)) * 1000
    for key in list(figures):
        if match := PERCENTILE_KEY.fullmatch(key):
            percentile, metric = float(match[1]), match[2]
            taken = seconds[metric] or [0.0]
            figures[key] = float(np.percentile(taken, percentile)) * 1000
    return figures
