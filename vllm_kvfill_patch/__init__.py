"""Hot-fix for vLLM's DecodeBenchConnector on hybrid / linear-attention models.

Importing this package registers a wrapt post-import hook on vLLM's
DecodeBenchConnector module; it imports neither vLLM nor the connector. When
the connector module is (or already was) imported, the hook decides from the
module's structure whether the patch is needed (``gating``) and installs it
(``worker_step``, where the patch is documented). vLLM's
``vllm.general_plugins`` entry point calls :func:`load_vllm_plugin` in every
vLLM process, so spawned engine-core and worker processes are patched too.

Set ``KVFILL_PATCH_DISABLE=1`` to leave vLLM untouched, ``KVFILL_PATCH_REFILL=0``
to leave out the refill of preempted requests (``preemption``) alone.

Promises, whatever other patches sit on the same methods: :func:`apply`,
:func:`revert`, :func:`status`, the plugin entry and the import hook never
raise. Where another library's plain (non-wrapt) wrapper sits above ours,
ours cannot be taken out; it then passes every call straight to what it
wraps, and the status says so.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging
import multiprocessing
import os
import socket
import sys
import threading
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import wrapt

from vllm_kvfill_patch import decision_log
from vllm_kvfill_patch.gating import (
    CONNECTOR_MODULE,
    FILL,
    PREFIX_HIT,
    REFILL,
    Decision,
    judge,
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

__version__ = importlib.metadata.version("vllm-kvfill-patch")
"""This hot-fix's version (pyproject.toml; CHANGELOG.md says what each has)."""

KILL_SWITCH = "KVFILL_PATCH_DISABLE"
_DISABLED_REASON = f"{KILL_SWITCH} is set"
REFILL_SWITCH = "KVFILL_PATCH_REFILL"
"""``0`` leaves the refill of preempted requests out (upstream's behaviour)."""


@dataclass(frozen=True)
class PatchStatus:
    """What the patch decided in this process, and why."""

    vllm_version: str | None
    decision: Decision
    reason: str
    parts: tuple[str, ...] = ()
    """The parts of the patch active in this process: "fill" (worker side,
    ``worker_step``), "refill" and "prefix-hit" (scheduler side, ``preemption``,
    ``prefix_hit``)."""


@dataclass
class _Installer:
    """This process's patch state; every field is read and written under `lock`."""

    lock: threading.RLock = field(default_factory=threading.RLock)
    wanted: bool = False
    """apply() was called (or the package imported) and revert() was not."""
    hook_registered: bool = False
    handles: dict[str, wrapt.FunctionWrapper] = field(default_factory=dict)
    """Our wrappers in the connector module, by dotted path: the handles that
    remove exactly them. A handle stays here while ours cannot be removed."""
    applied_reason: str = ""
    """Why the gating applied the patch, for when a kept wrapper is re-armed."""
    applied_parts: tuple[str, ...] = ()
    status: PatchStatus = PatchStatus(
        None, Decision.PENDING, "the connector module is not imported yet"
    )
    logged: bool = False


_installer = _Installer()


def apply() -> PatchStatus:
    """Patch the connector now if it is imported, else when it is imported.

    Idempotent and thread-safe; never raises. With the kill switch set it
    takes the patch out instead and reports ``disabled``.
    """
    with _installer.lock:
        try:
            if _kill_switch_on():
                _installer.wanted = False
                leftover = _uninstall(sys.modules.get(CONNECTOR_MODULE))
                _decide(Decision.DISABLED, _DISABLED_REASON + leftover)
            else:
                _installer.wanted = True
                module = sys.modules.get(CONNECTOR_MODULE)
                _forget_replaced_wrappers(module)
                if _installer.handles:  # still in place: active again,
                    if module is not None:  # with what revert() took out
                        _install(module, _installer.applied_parts)
                    _decide(
                        Decision.APPLIED,
                        _installer.applied_reason,
                        _installer.applied_parts,
                    )
                else:
                    _register_hook()
        except Exception as exc:  # noqa: BLE001 - apply() never raises
            _decide(Decision.REFUSED, f"apply failed: {type(exc).__name__}: {exc}")
        return _installer.status


def revert() -> PatchStatus:
    """Take the patch out, restoring upstream's own function objects.

    Never raises. If another library's plain wrapper sits above ours, ours
    stays in the chain but passes every call through; the reason says so.
    """
    with _installer.lock:
        _installer.wanted = False
        try:
            leftover = _uninstall(sys.modules.get(CONNECTOR_MODULE))
        except Exception as exc:  # noqa: BLE001 - revert() never raises
            leftover = f"; removing failed ({type(exc).__name__}: {exc})"
        if _installer.status.decision in (Decision.APPLIED, Decision.PENDING):
            _decide(Decision.REVERTED, "reverted by revert()" + leftover)
        return _installer.status


def status() -> PatchStatus:
    """The decision made in this process (``pending`` until the connector loads)."""
    with _installer.lock:
        return _installer.status


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
    if _installer.hook_registered:
        return
    _installer.hook_registered = True
    # Fires at once when the module is already imported (revert then apply).
    wrapt.register_post_import_hook(_on_connector_import, CONNECTOR_MODULE)


def _on_connector_import(module: ModuleType) -> None:
    """The post-import hook. Must not raise: wrapt would fail the import."""
    with _installer.lock:
        _installer.hook_registered = False
        if not _installer.wanted or _installer.handles:
            return
        if _kill_switch_on():  # set after this package was imported
            _decide(Decision.DISABLED, _DISABLED_REASON)
            return
        try:
            verdict = judge(module, _vllm_version())
            reason, parts = verdict.reason, verdict.parts
            if REFILL in parts and _refill_switched_off():
                parts = tuple(part for part in parts if part != REFILL)
                reason += f" (refill left out: {REFILL_SWITCH}=0)"
            if verdict.decision is Decision.APPLIED:
                _install(module, parts)
                _installer.applied_reason = reason
                _installer.applied_parts = parts
            _decide(verdict.decision, reason, parts)
        except Exception as exc:  # noqa: BLE001 - never break vLLM's import
            leftover = ""
            try:
                leftover = _uninstall(module)
            except Exception:  # noqa: BLE001 - reported just below
                leftover = "; a wrapper may be left in place, passing calls through"
            _decide(
                Decision.REFUSED,
                f"installing failed: {type(exc).__name__}: {exc}{leftover}",
            )


def _install(module: ModuleType, parts: tuple[str, ...]) -> None:
    # Imported here: they import vLLM's logger, and vLLM is loaded by now.
    from vllm_kvfill_patch import preemption, prefix_hit, worker_step

    wrappers: dict[str, dict[str, Any]] = {
        FILL: worker_step.WRAPPERS,
        REFILL: preemption.WRAPPERS,
        PREFIX_HIT: prefix_hit.WRAPPERS,
    }
    for part in parts:
        for path, wrapper in wrappers[part].items():
            if path not in _installer.handles:
                _installer.handles[path] = wrapt.wrap_function_wrapper(
                    module, path, _while_ours(path, wrapper)
                )


def _while_ours(path: str, wrapper: Any) -> Any:
    """`wrapper` while the patch is wanted and this wrapper is the one kept
    for `path`; upstream's method otherwise.

    What makes revert() hold where our wrapper cannot be taken out, and keeps
    one we lost track of (a closure above it without ``__wrapped__``) passing
    calls through, whatever a later apply() decides.
    """

    def gate(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        handle = _installer.handles.get(path)
        if _installer.wanted and handle is not None and handle._self_wrapper is gate:
            return wrapper(wrapped, instance, args, kwargs)
        return wrapped(*args, **kwargs)

    return gate


def _uninstall(module: ModuleType | None) -> str:
    """Remove our wrappers; '' when all went, else why some stayed (inactive)."""
    stuck = []
    for path, handle in list(_installer.handles.items()):
        try:
            wrapt.unwrap_object(module, path, handle, missing_ok=True)
        except wrapt.WrapperNotOutermostError:
            pass
        if _in_place(module, path, handle):
            stuck.append(path)
        else:
            del _installer.handles[path]
    if not stuck:
        return ""
    return (
        "; another library's plain wrapper sits above ours on "
        + ", ".join(stuck)
        + ": ours stays in place and passes every call through"
    )


def _forget_replaced_wrappers(module: ModuleType | None) -> None:
    """Drop handles of our wrappers that someone replaced outright."""
    for path, handle in list(_installer.handles.items()):
        if not _in_place(module, path, handle):
            del _installer.handles[path]


def _in_place(module: ModuleType | None, path: str, handle: Any) -> bool:
    """Whether calls to `path` still go through our wrapper `handle`.

    A plain closure above ours may hold it bound (it was read through the
    class), so the bound form counts too.
    """
    owner_name, _, attribute = path.rpartition(".")
    owner = getattr(module, owner_name, None)
    current = owner.__dict__.get(attribute) if owner is not None else None
    if current is None:
        return False
    return wrapt.is_wrapped_by(
        current,
        predicate=lambda entry: (
            entry is handle or getattr(entry, "_self_parent", None) is handle
        ),
    )


def _decide(decision: Decision, reason: str, parts: tuple[str, ...] = ()) -> None:
    """Record a decision; log it when it is news in this process."""
    new_status = PatchStatus(_vllm_version(), decision, reason, parts)
    if _installer.logged and new_status == _installer.status:
        return
    _installer.status, _installer.logged = new_status, True
    level = logging.WARNING if new_status.decision is Decision.REFUSED else logging.INFO
    # Which process decided: a topology's processes (DP ranks, pipeline
    # stages, nodes) each decide, and not every launcher prefixes its lines.
    decision_log.log(
        level,
        "vllm-kvfill-patch %s for vLLM %s (hot-fix %s): %s%s [process %s, pid %d, "
        "host %s]",
        new_status.decision.value,
        new_status.vllm_version,
        __version__,
        new_status.reason,
        f" [parts: {', '.join(parts)}]" if parts else "",
        multiprocessing.current_process().name,
        os.getpid(),
        socket.gethostname(),
    )


def _connector_exists() -> bool:
    try:
        return importlib.util.find_spec(CONNECTOR_MODULE) is not None
    except ModuleNotFoundError as exc:
        if exc.name and (CONNECTOR_MODULE + ".").startswith(exc.name + "."):
            return False  # vllm itself, or a parent package, is absent
        raise


def _kill_switch_on() -> bool:
    return _env_switch(KILL_SWITCH) not in ("", *_OFF)


def _refill_switched_off() -> bool:
    return _env_switch(REFILL_SWITCH) in _OFF


_OFF = ("0", "false", "no")


def _env_switch(name: str) -> str:
    return os.environ.get(name, "").strip().lower()


def _vllm_version() -> str | None:
    vllm = sys.modules.get("vllm")
    return getattr(vllm, "__version__", None) if vllm is not None else None


# Importing the package is the first way to use it: register the hook now.
# With the kill switch set, the status says so without a log line (no vLLM
# version to name yet); apply() and the plugin log it.
with _installer.lock:
    if _kill_switch_on():
        _installer.status = PatchStatus(None, Decision.DISABLED, _DISABLED_REASON)
    else:
        _installer.wanted = True
        _register_hook()
