"""Python imports this at start in every process whose PYTHONPATH names this
directory: a topology test names it for the processes it starts, with
KVFILL_TRACE_DIR set (tests/engine/trace.py), and, for a Ray node's
processes, KVFILL_RAY_DEVICE_KEY (engine_probe.declare_ray_device_key).
Nothing happens without them."""

import os

if os.environ.get("KVFILL_TRACE_DIR"):
    from tests.engine import trace

    trace.start()

if os.environ.get("KVFILL_RAY_DEVICE_KEY"):
    from tests.engine import engine_probe

    engine_probe.declare_ray_device_key(os.environ["KVFILL_RAY_DEVICE_KEY"])
