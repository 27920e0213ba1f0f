"""Hot-fix for vLLM's DecodeBenchConnector on hybrid / linear-attention models.

Importing this package registers a wrapt post-import hook on vLLM's
DecodeBenchConnector module (``installer``); it imports neither vLLM nor the
connector. When the connector module is (or already was) imported, the hook
decides from the module's structure whether the patch is needed (``gating``)
and installs it (``worker_step``, where the patch is documented). vLLM's
``vllm.general_plugins`` entry point calls :func:`load_vllm_plugin` in every
vLLM process, so spawned engine-core and worker processes are patched too.

The benchmark keeps a decode node's semantics: each request is filled once,
and a request vLLM preempts is recomputed when it resumes. The refill of
preempted requests (``preemption``), which emulates a node with an offload
tier, is an option: ``refill_preempted`` in the connector's
``kv_connector_extra_config``, or ``KVFILL_PATCH_REFILL=1``. Set
``KVFILL_PATCH_DISABLE=1`` to leave vLLM untouched (``switches``).

:func:`apply`, :func:`revert`, :func:`status`, the plugin entry and the
import hook never raise.
"""

from __future__ import annotations

from vllm_kvfill_patch._version import __version__
from vllm_kvfill_patch.gating import Decision
from vllm_kvfill_patch.installer import (
    PatchStatus,
    apply,
    load_vllm_plugin,
    register_on_import,
    revert,
    status,
)

__all__ = [
    "Decision",
    "PatchStatus",
    "__version__",
    "apply",
    "load_vllm_plugin",
    "revert",
    "status",
]

# Importing the package is the first way to use it.
register_on_import()
