"""Hot-fix for vLLM's DecodeBenchConnector on hybrid / linear-attention models.

Importing this package registers a wrapt post-import hook on vLLM's
DecodeBenchConnector module; it imports neither vLLM nor the connector. When
the connector module is (or already was) imported, the hook decides from the
module's structure whether the patch is needed (``gating``) and installs it
(``replacement``, where the patch is documented). vLLM's
``vllm.general_plugins`` entry point calls :func:`load_vllm_plugin` in every
vLLM process, so spawned engine-core and worker processes are patched too.

Set ``KVFILL_PATCH_DISABLE=1`` to leave vLLM untouched.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
import threading
from dataclasses import dataclass
from types import ModuleType

import wrapt

from vllm_kvfill_patch.gating import CONNECTOR_MODULE, Decision, judge

__all__ = ["Decision", "PatchStatus", "apply", "load_vllm_plugin", "revert", "status"]

KILL_SWITCH = "KVFILL_PATCH_DISABLE"
_DISABLED_REASON = f"{KILL_SWITCH} is set"

# Under vLLM's logger namespace, so vLLM's handlers and levels apply.
logger = logging.getLogger("vllm.kvfill_patch")


@dataclass(frozen=True)
class PatchStatus:
    """What the patch decided in this process, and why."""

    vllm_version: str | None
    decision: Decision
    reason: str


_lock = threading.RLock()
_hook_registered = False
_wanted = False
_handles: dict[str, wrapt.FunctionWrapper] = {}
_status = PatchStatus(
    None, Decision.PENDING, "the connector module is not imported yet"
)
_logged = False


def apply() -> PatchStatus:
    """Patch the connector now if it is imported, else when it is imported.

    Idempotent and thread-safe; never raises. With the kill switch set it
    removes the patch instead and reports ``disabled``.
    """
    global _wanted
    with _lock:
        if _kill_switch_on():
            _wanted = False
            _uninstall(sys.modules.get(CONNECTOR_MODULE))
            _decide(Decision.DISABLED, _DISABLED_REASON)
        else:
            _register_hook()
        return _status


def revert() -> PatchStatus:
    """Restore upstream's methods (the original function objects)."""
    global _wanted
    with _lock:
        _wanted = False
        _uninstall(sys.modules.get(CONNECTOR_MODULE))
        if _status.decision in (Decision.APPLIED, Decision.PENDING):
            _decide(Decision.INERT, "reverted by revert()")
        return _status


def status() -> PatchStatus:
    """The decision made in this process (``pending`` until the connector loads)."""
    with _lock:
        return _status


def load_vllm_plugin() -> None:
    """The ``vllm.general_plugins`` entry point: apply, and decide right away.

    vLLM calls it in its API, engine-core and worker processes, possibly more
    than once in each; every call after the first changes nothing.
    """
    if apply().decision is not Decision.PENDING:
        return
    try:
        if _connector_exists():
            importlib.import_module(CONNECTOR_MODULE)
        else:
            _decide(Decision.INERT, "no DecodeBenchConnector in this vLLM (or no vLLM)")
    except Exception as exc:  # noqa: BLE001 - a plugin must never break vLLM
        _decide(
            Decision.REFUSED,
            f"could not import the connector: {type(exc).__name__}: {exc}",
        )


def _register_hook() -> None:
    global _hook_registered, _wanted
    _wanted = True
    if _handles or _hook_registered:
        return
    _hook_registered = True
    # Fires at once when the module is already imported (revert then apply).
    wrapt.register_post_import_hook(_on_connector_import, CONNECTOR_MODULE)


def _on_connector_import(module: ModuleType) -> None:
    """The post-import hook. Must not raise: wrapt would fail the import."""
    global _hook_registered
    with _lock:
        _hook_registered = False
        if not _wanted or _handles:
            return
        if _kill_switch_on():  # set after this package was imported
            _decide(Decision.DISABLED, _DISABLED_REASON)
            return
        try:
            verdict = judge(module, _vllm_version())
            if verdict.decision is Decision.APPLIED:
                _install(module)
            _decide(verdict.decision, verdict.reason)
        except Exception as exc:  # noqa: BLE001 - never break vLLM's import
            _uninstall(module)
            _decide(Decision.REFUSED, f"installing failed: {type(exc).__name__}: {exc}")


def _install(module: ModuleType) -> None:
    # Imported here: it imports vLLM's logger, and vLLM is loaded by now.
    from vllm_kvfill_patch.replacement import WRAPPERS

    for path, wrapper in WRAPPERS.items():
        _handles[path] = wrapt.wrap_function_wrapper(module, path, wrapper)


def _uninstall(module: ModuleType | None) -> None:
    for path, handle in list(_handles.items()):
        wrapt.unwrap_object(module, path, handle, missing_ok=True)
        del _handles[path]


def _decide(decision: Decision, reason: str) -> None:
    """Record a decision; log it when it is news in this process."""
    global _status, _logged
    new_status = PatchStatus(_vllm_version(), decision, reason)
    if _logged and new_status == _status:
        return
    _status, _logged = new_status, True
    level = logging.WARNING if new_status.decision is Decision.REFUSED else logging.INFO
    logger.log(
        level,
        "vllm-kvfill-patch %s for vLLM %s: %s",
        new_status.decision.value,
        new_status.vllm_version,
        new_status.reason,
    )


def _connector_exists() -> bool:
    try:
        return importlib.util.find_spec(CONNECTOR_MODULE) is not None
    except ModuleNotFoundError as exc:
        if exc.name and (CONNECTOR_MODULE + ".").startswith(exc.name + "."):
            return False  # vllm itself, or a parent package, is absent
        raise


def _kill_switch_on() -> bool:
    value = os.environ.get(KILL_SWITCH, "").strip().lower()
    return value not in ("", "0", "false", "no")


def _vllm_version() -> str | None:
    vllm = sys.modules.get("vllm")
    return getattr(vllm, "__version__", None) if vllm is not None else None


# Importing the package is the first way to use it: register the hook now.
# With the kill switch set, the status says so without a log line (vLLM's
# logging may not be configured yet); apply() and the plugin log it.
with _lock:
    if _kill_switch_on():
        _status = PatchStatus(None, Decision.DISABLED, _DISABLED_REASON)
    else:
        _register_hook()
