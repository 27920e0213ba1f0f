"""NIXL's progress thread given a rest between its polls, in the real decode
node's servers (`node`): where the node shares two cores, not the spinning
thread a node with cores to spare gives a core of its own.

NIXL's Python API creates each agent with ``pthrDelay = 0``: its progress
thread polls UCX without rest, a core's worth of work. On a machine with
cores to spare it has one; on two cores it shares the one the decode
worker leaves with vLLM's API server, its engine side, the prefill server
and the client, and the node's transfers wait for it. With
`wire.NIXL_REST_ENV` set (microseconds), each agent of the process is created with
that delay between polls instead: the thread sleeps between them. The
threads the bound agent starts are written to ``<probe dir>/<pid>.nixl``
(`wire.NIXL_THREADS`), so that the tool keeps them at the worker's priority
while it lowers the threads that spin. UCX's progress thread is not among
them: it starts with the agent's backend, after the bound agent, and is
lowered with the workers' other threads (``SCHED_IDLE``); on the front core
it runs whenever the engine core's spin-wait yields (docs/benchmark.md,
"The node's way in and out").
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from vllm_kvfill_patch.fidelity.wire import DIR_ENV, NIXL_REST_ENV, NIXL_THREADS

BINDINGS = ("nixl_cu12._bindings", "nixl_cu13._bindings", "nixl._bindings")
"""Where NIXL's agent class is, by build (the ``nixl`` meta package loads
one of them)."""


def install() -> None:
    """Rest NIXL's progress thread in this process, if the tool asked for it."""
    rest = os.environ.get(NIXL_REST_ENV)
    if not rest:
        return
    import wrapt

    def rest_agents(bindings: Any) -> None:
        def agent(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
            config = args[1] if len(args) > 1 else kwargs.get("config")
            if config is not None:
                config.pthrDelay = int(rest)
            before = set(os.listdir("/proc/self/task"))
            created = wrapped(*args, **kwargs)
            started = set(os.listdir("/proc/self/task")) - before
            if directory := os.environ.get(DIR_ENV):
                with (Path(directory) / f"{os.getpid()}{NIXL_THREADS}").open(
                    "a"
                ) as out:
                    out.writelines(f"{tid}\n" for tid in sorted(started))
            return created

        wrapt.wrap_function_wrapper(bindings, "nixlAgent", agent)

    for name in BINDINGS:
        wrapt.register_post_import_hook(rest_agents, name)
