"""Runs one function of ``children.py`` in this fresh interpreter.

    python tests/fresh.py FUNCTION JSON_ARGS

Run as a script, so this directory (not the checkout) leads sys.path: the
vllm_kvfill_patch imported is the installed one. The last stdout line is the
function's JSON report.
"""

import json
import sys

import children

if __name__ == "__main__":
    function = getattr(children, sys.argv[1])
    print(json.dumps(function(*json.loads(sys.argv[2]))), flush=True)
