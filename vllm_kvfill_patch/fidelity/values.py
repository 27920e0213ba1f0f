"""What the fill's values do to a decode step, step by step inside one engine.

    python -m vllm_kvfill_patch.fidelity.values                # embedded model
    python -m vllm_kvfill_patch.fidelity.values --concurrency 8 --cycles 200

End to end, a small difference between modes drowns in the machine's noise,
which moves a mode's TPOT from run to run. Here the modes take turns step by
step, in one in-process vLLM engine running the same requests: before each
decode step the whole KV cache is set to one of

- ``real``: what real prefill of the requests left in it (the truth);
- ``fill``: the same, then DecodeBenchConnector's fill of the requests'
  blocks, through this package's step (the values a benchmark decodes on);
- ``zero``: all zeros (a cache nothing was written to);

and the step is timed (``LLMEngine.step``: schedule, forward, sample). A
cycle takes each once, in a rotated order; each cycle's ratios to ``real``
pair steps milliseconds apart, so the machine's drift cancels. Prints the
median step per state and each against ``real``: the median of the cycles'
ratios and its 95% confidence interval. The copy that sets the cache is not
timed. Tokens and positions are the engine's own, whatever the cache holds:
the arithmetic is the model's, on each state's values. The tokens decoded
add to each request's context (3 a cycle), in blocks that `real` and `fill`
hold alike, so the prompt's share of the attention shrinks as the cycles go:
at 200 cycles, to about half.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from vllm_kvfill_patch.fidelity.args import HelpFormatter
from vllm_kvfill_patch.fidelity.model import (
    EMBEDDED_ENV,
    SPECIAL_TOKENS,
    TINY_HYBRID_MOE,
    write_embedded_model,
)
from vllm_kvfill_patch.fidelity.modes import CONNECTOR, add_fill_config_argument
from vllm_kvfill_patch.fidelity.stats import paired_ratio

VOCABULARY: int = TINY_HYBRID_MOE["vocab_size"]  # type: ignore[assignment]
STATES = ("real", "fill", "zero")
"""The KV-cache contents a decode step is timed on; `real` is the reference."""


def parser() -> argparse.ArgumentParser:
    """The command line: every option with its help, grouped, its default
    shown."""
    parser = argparse.ArgumentParser(
        prog="python -m vllm_kvfill_patch.fidelity.values",
        description=(__doc__ or "").splitlines()[0],
        formatter_class=HelpFormatter,
    )
    measured = parser.add_argument_group("what is measured")
    measured.add_argument(
        "--concurrency", type=int, nargs="+", default=[1, 8, 32],
        help="requests decoding together in a timed step, each in turn",
    )  # fmt: skip
    measured.add_argument(
        "--input-len", type=int, default=512, help="prompt tokens of each request"
    )
    measured.add_argument(
        "--cycles", type=int, default=200, help="decode steps per state and batch"
    )
    add_fill_config_argument(measured)
    files = parser.add_argument_group("files")
    files.add_argument(
        "--model-dir", type=Path,
        help="where the embedded model is written (default: a temporary directory)",
    )  # fmt: skip
    files.add_argument(
        "--output", type=Path, help="a JSON file for the steps' times (default: none)"
    )
    return parser


def whole_storages(kv_caches: dict) -> list[Any]:
    """Each distinct memory block under the worker's KV caches, as one flat
    byte tensor (hybrid models' layers share pools: one copy of each)."""
    import torch

    tensors = []
    for cache in kv_caches.values():
        tensors += list(cache) if isinstance(cache, (list, tuple)) else [cache]
    storages: dict[int, Any] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in storages:
            flat = torch.empty(0, dtype=torch.uint8, device=tensor.device)
            storages[storage.data_ptr()] = flat.set_(storage)
    return list(storages.values())


class Engine:
    """An in-process vLLM engine with DecodeBenchConnector (and this package,
    through vLLM's plugin entry point, as users get it), whose scheduler
    admits requests with real prefill: the tool fills them itself, through
    the connector's worker, when it wants the fill."""

    def __init__(
        self, model: str, fill_config: dict, max_requests: int, max_model_len: int
    ) -> None:
        from vllm import LLM

        config: dict[str, Any] = dict(CONNECTOR)
        if fill_config:
            config["kv_connector_extra_config"] = fill_config
        self.llm = LLM(
            model=model, load_format="dummy", enforce_eager=True, dtype="bfloat16",
            max_model_len=max_model_len, max_num_seqs=max_requests,
            kv_cache_memory_bytes=1 << 27, distributed_executor_backend="uni",
            kv_transfer_config=config,
        )  # fmt: skip
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        self.engine = self.llm.llm_engine
        self.scheduler = self.engine.engine_core.engine_core.scheduler
        self.worker_connector = get_kv_transfer_group()
        # Real prefill for every request: the connector matches nothing.
        self.scheduler.connector.get_num_new_matched_tokens = lambda *args: (0, False)
        self.storages = whole_storages(self.worker_connector.connector_worker.kv_caches)

    def snapshot(self) -> list[Any]:
        return [storage.clone() for storage in self.storages]

    def restore(self, snapshot: list[Any]) -> None:
        for storage, saved in zip(self.storages, snapshot, strict=True):
            storage.copy_(saved)

    def fill(self, request_ids: list[str]) -> None:
        """DecodeBenchConnector's fill of these requests' blocks, by its
        worker's step, as at their admission: every prompt token but the
        last."""
        from vllm.distributed.kv_transfer.kv_connector.v1 import decode_bench_connector

        reqs_to_fill = {}
        manager = self.scheduler.kv_cache_manager
        for request_id in request_ids:
            tokens = len(self.scheduler.requests[request_id].prompt_token_ids) - 1
            reqs_to_fill[request_id] = (manager.get_block_ids(request_id), tokens)
        self.worker_connector.bind_connector_metadata(
            decode_bench_connector.DecodeBenchConnectorMetadata(reqs_to_fill)
        )
        try:
            self.worker_connector.start_load_kv(None)
        finally:
            self.worker_connector.clear_connector_metadata()


def decode_steps(cycles: int) -> int:
    """Tokens each request generates: its first two before the states are
    saved, a step per state and cycle, and a margin."""
    return cycles * len(STATES) + 4


def check_not_preempted(requests: dict, concurrency: int) -> None:
    """A preempted request is prefilled again (over a state copied in): the
    comparison needs every request running throughout."""
    if any(request.num_preemptions for request in requests.values()):
        raise RuntimeError(
            f"vLLM preempted requests at concurrency {concurrency}: its KV cache "
            "holds fewer; take a smaller --input-len or --cycles"
        )


def measure(engine: Engine, concurrency: int, input_len: int, cycles: int) -> dict:
    """Each state's step times for `concurrency` running requests, and the
    bytes of the cache the fill changed."""
    import torch
    from vllm import SamplingParams

    generator = torch.Generator().manual_seed(concurrency)
    params = SamplingParams(max_tokens=decode_steps(cycles), ignore_eos=True)
    ids = [f"c{concurrency}-{i}" for i in range(concurrency)]
    for request_id in ids:
        prompt = torch.randint(
            len(SPECIAL_TOKENS), VOCABULARY, (input_len,), generator=generator
        ).tolist()
        engine.engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    # Real prefill, then a decode step each: every request is running (the
    # scheduler's ids are the engine's own, made from these).
    requests = engine.scheduler.requests
    while len(requests) < len(ids) or any(
        request.num_output_tokens < 2 for request in requests.values()
    ):
        engine.engine.step()
        check_not_preempted(requests, concurrency)
    contents = {"real": engine.snapshot()}
    engine.fill(list(requests))
    contents["fill"] = engine.snapshot()
    contents["zero"] = [torch.zeros_like(saved) for saved in contents["real"]]
    filled = sum(
        int((real != fill).sum())
        for real, fill in zip(contents["real"], contents["fill"], strict=True)
    )
    times: dict[str, list[float]] = {state: [] for state in STATES}
    for cycle in range(cycles):
        shift = cycle % len(STATES)
        for state in STATES[shift:] + STATES[:shift]:
            engine.restore(contents[state])
            started = time.perf_counter()
            engine.engine.step()
            times[state].append(time.perf_counter() - started)
    check_not_preempted(requests, concurrency)
    engine.engine.abort_request(ids)
    while engine.engine.has_unfinished_requests():
        engine.engine.step()
    return {"filled_bytes": filled, "cache_bytes": sum(map(len, contents["real"])),
            "seconds": times}  # fmt: skip


def table(results: dict[int, dict]) -> str:
    lines = [
        "| C | state | step p50 ms | vs real [95% CI] |",
        "|---|---|---|---|",
    ]
    for concurrency, result in results.items():
        times = result["seconds"]
        for state in STATES:
            p50 = statistics.median(times[state]) * 1000
            if state == "real":
                versus = "(reference)"
            else:
                versus = paired_ratio(times[state], times["real"]).text(1)
            lines.append(f"| {concurrency} | {state} | {p50:.2f} | {versus} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)

    os.environ.update(EMBEDDED_ENV)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    with tempfile.TemporaryDirectory() as scratch:
        model = write_embedded_model(args.model_dir or Path(scratch) / "model")
        engine = Engine(
            str(model),
            json.loads(args.fill_config),
            max(args.concurrency),
            args.input_len + decode_steps(args.cycles),
        )
        results = {}
        for concurrency in args.concurrency:
            result = measure(engine, concurrency, args.input_len, args.cycles)
            print(
                f"C={concurrency}: {args.cycles} cycles; the fill changed "
                f"{result['filled_bytes']:,} of the cache's "
                f"{result['cache_bytes']:,} bytes",
                flush=True,
            )
            results[concurrency] = result
    print(table(results))
    if args.output:
        args.output.write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
