"""Python imports this at start in every process whose PYTHONPATH names this
directory: a topology test names it for the processes it starts, with
KVFILL_TRACE_DIR set (tests/engine/trace.py). Nothing happens without it."""

import os

if os.environ.get("KVFILL_TRACE_DIR"):
    from tests.engine import trace

    trace.start()
