"""The installer: puts the patch's parts into vLLM's connector module, takes
them out, and keeps this process's status.

A post-import hook on the connector module decides from the module's
structure whether the patch is needed (``gating``) and wraps the methods each
part needs. What a part reports back (a connector's options asking for the
refill) reaches the installer through what it hands the part when it
installs it: no part imports the installer or the package.

Promises, whatever other patches sit on the same methods: :func:`apply`,
:func:`revert`, :func:`status`, the plugin entry and the import hook never
raise. Where another library's plain (non-wrapt) wrapper sits above ours,
ours cannot be taken out; it then passes every call straight to what it
wraps, and the status says so.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import multiprocessing
import os
import socket
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from types import ModuleType
from typing import TYPE_CHECKING, Any

import wrapt

from vllm_kvfill_patch import decision_log, switches
from vllm_kvfill_patch._version import __version__
from vllm_kvfill_patch.gating import (
    CONNECTOR_MODULE,
    FILL,
    FILL_ONCE,
    LINK,
    LINK_METRICS,
    OPTIONS,
    PREFIX_HIT,
    REFILL,
    Decision,
    Verdict,
    judge,
)

if TYPE_CHECKING:  # the part's module is imported with the parts
    from vllm_kvfill_patch.link import LinkModel

Wrapper = Callable[[Any, Any, tuple, dict], Any]

_DISABLED_REASON = f"{switches.KILL_SWITCH} is set"

NOT_APPLIED = "upstream's (this package is not applied)"
DECODE_NODE = (
    "a decode node's: each request filled once, a preempted request recomputed"
)
OFFLOAD_TIER = "a decode node with an offload tier: a preempted request filled again"
UPSTREAM_REFILL = "upstream's: a preempted request filled again"
LINK_OPTIONS = "transfer_latency_ms / transfer_gbps"


@dataclass(frozen=True)
class PatchStatus:
    """What the patch decided in this process, and why, as fields: the log
    line and ``python -m vllm_kvfill_patch`` print them, so that none of it
    is read back out of a sentence."""

    vllm_version: str | None
    decision: Decision
    defects: str
    """What the probes of upstream's own methods found wrong ("; " between
    them) where the decision is ``applied``; otherwise why the patch is not
    in force."""
    parts: tuple[str, ...] = ()
    """The parts of the patch active in this process: "fill" (worker side,
    ``worker_step``), "fill-once", "prefix-hit" and the opt-in "refill"
    (scheduler side: ``fill_once``, ``prefix_hit``, ``preemption``), the
    opt-in "link" (both sides: ``link``), "link-metrics" (the link's
    transfers read into vLLM's metrics: ``link_stats``) and "options" (the
    connector's options checked: ``options``)."""
    preemption: str = NOT_APPLIED
    """What the benchmark emulates after a preemption: a decode node's
    recompute, or (the opt-in refill) a node with an offload tier;
    upstream's own where the patch is not applied."""
    preemption_why: str = ""
    """What set it (a switch, a connector's options, the refill being
    opt-in); empty where the patch is not applied."""
    link: LinkModel | None = None
    """The link model a connector's options put in force (the link part);
    None: the KV arrives in the step that admits the request."""

    @property
    def semantics(self) -> str:
        """What the benchmark emulates: after a preemption, and how the KV
        arrives."""
        if self.link is None:
            return self.preemption
        return f"{self.preemption}; its KV over a modelled link ({self.link})"

    @property
    def semantics_why(self) -> str:
        """What set the semantics."""
        if self.link is None:
            return self.preemption_why
        return f"{self.preemption_why}; {LINK_OPTIONS} in the connector's options"

    @property
    def reason(self) -> str:
        """The defects, then the semantics in force and why: the log line's."""
        if not self.semantics_why:
            return self.defects
        return f"{self.defects}; semantics: {self.semantics} ({self.semantics_why})"


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
    applied: PatchStatus | None = None
    """The status the gating's verdict gave, for when a kept wrapper is re-armed."""
    refill_available: bool = False
    """Upstream recomputes preempted requests here: the refill can be opted
    into (by a connector's options, after the decision)."""
    refill_source: str = ""
    """What asked for the refill in a connector's options, once one did: it
    stays in force through revert() and apply()."""
    link_available: bool = False
    """Upstream loads synchronously here: the link model can be opted into."""
    link_model: LinkModel | None = None
    """The link model a connector's options asked for, once one did."""
    draining: frozenset[str] = frozenset()
    """The link's worker-side reports revert() left in place, for transfers
    this process's workers had not reported yet: they report them, then
    pass calls through."""
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
            if switches.kill_switch_on():
                _installer.wanted = False
                leftover = _uninstall(sys.modules.get(CONNECTOR_MODULE))
                _decide(Decision.DISABLED, _DISABLED_REASON + leftover)
            else:
                _installer.wanted, _installer.draining = True, frozenset()
                module = sys.modules.get(CONNECTOR_MODULE)
                _forget_replaced_wrappers(module)
                applied = _installer.applied
                if _installer.handles and applied is not None:  # still in place:
                    if module is not None:  # active again, with what revert()
                        _install(module, applied.parts)  # took out
                    _record(applied)
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
        reverted = (Decision.APPLIED, Decision.PENDING, Decision.REVERTED)
        if _installer.status.decision in reverted:
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


def refill_opted_in(source: str) -> None:
    """A connector's options (or the fidelity tool) asked for the refill: put
    it in, and say so in this process's status, with `source` as the why.
    Handed to the options part when it is installed; never raises: it runs
    while a connector is built."""
    with _opting_in("refill"):
        _installer.refill_source = source
        applied = _installer.applied
        if (
            not _installer.refill_available
            or applied is None
            or REFILL in applied.parts
            or switches.refill_switch() is False
        ):
            return
        _put_in(_with_refill(applied, source))


def link_opted_in(model: LinkModel) -> None:
    """A connector's options asked for the link model: put the link part in,
    and name the model in this process's status. Handed to the options part
    when it is installed; never raises: it runs while a connector is built."""
    with _opting_in("link model"):
        _installer.link_model = model
        applied = _installer.applied
        if applied is None or not _installer.link_available:
            decision_log.log(
                logging.WARNING,
                "vllm-kvfill-patch: the connector's options ask for a link "
                "model (%s), but the patch is not applied with it here (%s): "
                "the KV arrives as upstream's connector delivers it",
                model,
                _installer.status.reason,
            )
            return
        _put_in(_with_link(applied, model))


@contextlib.contextmanager
def _opting_in(what: str) -> Iterator[None]:
    """Under the lock; a failure is this process's refusal, never raised."""
    with _installer.lock:
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - never fail building a connector
            _decide(
                Decision.REFUSED,
                f"installing the {what} failed: {type(exc).__name__}: {exc}",
            )


def _put_in(applied: PatchStatus) -> None:
    """`applied` is the status to apply; in force at once where the patch is."""
    _installer.applied = applied
    if _installer.wanted and _installer.status.decision is Decision.APPLIED:
        _install(sys.modules[CONNECTOR_MODULE], applied.parts)
        _record(applied)


def link_opted_out() -> None:
    """No link model from now on (the fidelity tool's modes without one):
    the status says so; the part's wrappers pass calls through where no
    connector has a link. Never raises."""
    with _installer.lock:
        _installer.link_model = None
        applied = _installer.applied
        if applied is None or LINK not in applied.parts:
            return
        _installer.applied = _without_link(applied)
        if _installer.wanted and _installer.status.decision is Decision.APPLIED:
            _record(_installer.applied)


def register_on_import() -> None:
    """What importing the package does: register the hook now. With the kill
    switch set, the status says so without a log line (no vLLM version to
    name yet); apply() and the plugin log it."""
    with _installer.lock:
        if switches.kill_switch_on():
            _installer.status = PatchStatus(None, Decision.DISABLED, _DISABLED_REASON)
        else:
            _installer.wanted = True
            _register_hook()


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
        if switches.kill_switch_on():  # set after this package was imported
            _decide(Decision.DISABLED, _DISABLED_REASON)
            return
        try:
            verdict = judge(module, _vllm_version())
            if verdict.decision is not Decision.APPLIED:
                _decide(verdict.decision, verdict.reason)
                return
            applied = _applied_status(verdict)
            _install(module, applied.parts)
            _installer.applied = applied
            _installer.refill_available = verdict.refill_available
            _installer.link_available = verdict.link_available
            _record(applied)
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


def _applied_status(verdict: Verdict) -> PatchStatus:
    """The status of an applied verdict: its parts, with the opt-ins a switch
    or a connector's options put in, and the semantics in force, with what
    set them."""
    applied = _refill_status(verdict)
    model = _installer.link_model
    return (
        applied
        if model is None or not verdict.link_available
        else _with_link(applied, model)
    )


def _refill_status(verdict: Verdict) -> PatchStatus:
    """The status of an applied verdict as the refill's switch and options
    leave it."""
    applied = PatchStatus(
        _vllm_version(), Decision.APPLIED, verdict.reason, verdict.parts
    )
    if not verdict.refill_available:
        why = "upstream's connector fills a preempted request again itself"
        return replace(applied, preemption=UPSTREAM_REFILL, preemption_why=why)
    switch, source = switches.refill_switch(), _installer.refill_source
    if switch is True or (switch is None and source):
        return _with_refill(
            applied, f"{switches.REFILL_SWITCH}=1" if switch else source
        )
    if switch is False:
        why = f"{switches.REFILL_SWITCH}=0"
    else:
        why = "the refill is opt-in: refill_preempted in the connector's options"
        if unknown := switches.refill_switch_unknown():
            why += f"; {switches.REFILL_SWITCH}={unknown!r} is neither 1 nor 0, ignored"
    return replace(applied, preemption=DECODE_NODE, preemption_why=why)


def _with_refill(applied: PatchStatus, why: str) -> PatchStatus:
    """`applied` with the refill in (before the link, where it is in), and
    the semantics it sets, asked for by `why`."""
    others = tuple(part for part in applied.parts if part != LINK)
    link = (LINK,) if LINK in applied.parts else ()
    return replace(
        applied,
        parts=(*others, REFILL, *link),
        preemption=OFFLOAD_TIER,
        preemption_why=why,
    )


def _with_link(applied: PatchStatus, model: LinkModel) -> PatchStatus:
    """`applied` with the link part in, its model `model`."""
    without = _without_link(applied)
    return replace(without, parts=(*without.parts, LINK), link=model)


def _without_link(applied: PatchStatus) -> PatchStatus:
    """`applied` without the link part."""
    parts = tuple(part for part in applied.parts if part != LINK)
    return replace(applied, parts=parts, link=None)


def _install(module: ModuleType, parts: tuple[str, ...]) -> None:
    for part in parts:
        for path, wrapper in _wrappers(part, module).items():
            if path not in _installer.handles:
                _installer.handles[path] = wrapt.wrap_function_wrapper(
                    module, path, _while_ours(path, wrapper)
                )


def _wrappers(part: str, module: ModuleType) -> Mapping[str, Wrapper]:
    """What `part` wraps, by dotted path in the connector `module`; the
    options part is handed the callbacks to report an opt-in to, the link
    part the worker's fill."""
    # Imported here: they import vLLM's logger, and vLLM is loaded by now.
    from vllm_kvfill_patch import (
        fill_once,
        link,
        link_handshake,
        link_stats,
        options,
        preemption,
        prefix_hit,
        worker_step,
    )

    if part == OPTIONS:
        return options.wrappers(options.Reporters(refill_opted_in, link_opted_in))
    if part == LINK:
        connector = module.DecodeBenchConnector
        return {
            **link.wrappers(connector, worker_step.fill_arrived),
            **link_handshake.wrappers(connector),
            **link_stats.WORKER_WRAPPERS,
        }
    by_part: dict[str, Mapping[str, Wrapper]] = {
        LINK_METRICS: link_stats.READER_WRAPPERS,
        FILL: worker_step.WRAPPERS,
        FILL_ONCE: fill_once.WRAPPERS,
        PREFIX_HIT: prefix_hit.WRAPPERS,
        REFILL: preemption.WRAPPERS,
    }
    return by_part[part]


def _while_ours(path: str, wrapper: Wrapper) -> Wrapper:
    """`wrapper` while the patch is wanted and this wrapper is the one kept
    for `path`; upstream's method otherwise.

    What makes revert() hold where our wrapper cannot be taken out, and keeps
    one we lost track of (a closure above it without ``__wrapped__``) passing
    calls through, whatever a later apply() decides.
    """

    def gate(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        handle = _installer.handles.get(path)
        if (
            handle is not None
            and handle._self_wrapper is gate
            and (_installer.wanted or (path in _installer.draining and _unreported()))
        ):
            return wrapper(wrapped, instance, args, kwargs)
        return wrapped(*args, **kwargs)

    return gate


def _uninstall(module: ModuleType | None) -> str:
    """Remove our wrappers; '' when all went, else why some stayed (inactive,
    or reporting the link's transfers still in flight here)."""
    stuck = []
    unreported = _unreported()
    _installer.draining = frozenset(
        path
        for path in _installer.handles
        if unreported and path.rpartition(".")[2] in _link_reports()
    )
    for path, handle in list(_installer.handles.items()):
        if path in _installer.draining:
            continue
        try:
            wrapt.unwrap_object(module, path, handle, missing_ok=True)
        except wrapt.WrapperNotOutermostError:
            pass
        if _in_place(module, path, handle):
            stuck.append(path)
        else:
            del _installer.handles[path]
    said = (
        f"; the link's reports stay until the {unreported} transfers in flight "
        "here are reported, then pass calls through"
        if _installer.draining
        else ""
    )
    if not stuck:
        return said
    return (
        f"{said}; another library's plain wrapper sits above ours on "
        + ", ".join(stuck)
        + ": ours stays in place and passes every call through"
    )


def _unreported() -> int:
    """The link's transfers this process's workers took and have not
    reported (0 where the link part never loaded)."""
    link = sys.modules.get("vllm_kvfill_patch.link")
    return link.unreported() if link is not None else 0


def _link_reports() -> frozenset[str]:
    link = sys.modules.get("vllm_kvfill_patch.link")
    return link.WORKER_REPORTS if link is not None else frozenset()


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


def _decide(decision: Decision, why: str) -> None:
    """Record a decision other than ``applied``: why it holds, no parts."""
    _record(PatchStatus(_vllm_version(), decision, why))


def _record(new_status: PatchStatus) -> None:
    """Make `new_status` this process's; log it when it is news here."""
    if _installer.logged and new_status == _installer.status:
        return
    _installer.status, _installer.logged = new_status, True
    level = logging.WARNING if new_status.decision is Decision.REFUSED else logging.INFO
    parts = new_status.parts
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


def _vllm_version() -> str | None:
    vllm = sys.modules.get("vllm")
    return getattr(vllm, "__version__", None) if vllm is not None else None
