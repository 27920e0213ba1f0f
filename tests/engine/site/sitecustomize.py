"""Python imports this at start in every process whose PYTHONPATH names this
directory: a topology test names it for the processes it starts, with
KVFILL_TRACE_DIR set (tests/engine/trace.py), and, for a Ray node's
processes, KVFILL_RAY_DEVICE_KEY (engine_probe.declare_ray_device_key);
with KVFILL_DISABLE_IN_SPAWNED set, a process multiprocessing spawned (a
vLLM worker) starts with the package's kill switch on, the others as they
were. Nothing happens without them."""

import os
import sys

if (
    os.environ.get("KVFILL_DISABLE_IN_SPAWNED")
    and "--multiprocessing-fork" in sys.orig_argv
):
    os.environ["KVFILL_PATCH_DISABLE"] = "1"

if os.environ.get("KVFILL_TRACE_DIR"):
    from tests.engine import trace

    trace.start()

if os.environ.get("KVFILL_RAY_DEVICE_KEY"):
    from tests.engine import engine_probe

    engine_probe.declare_ray_device_key(os.environ["KVFILL_RAY_DEVICE_KEY"])
