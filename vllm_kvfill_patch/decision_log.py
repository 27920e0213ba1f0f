"""The line each process logs with the patch's decision, held where vLLM's
logging is not configured yet.

vLLM up to 0.30 configures its logging when ``vllm.logger`` is imported.
0.31+ configures it only when an engine or the CLI starts, and a process can
import the connector, and so decide, before that: an in-process
``LLM(...)``, or the driver of a Ray executor, whose engine core runs there.
An INFO line logged then goes nowhere. So the line is held, and logged as
soon as vLLM configures its logging: ``vllm.logger._configure_vllm_root_logger``
(every configuration goes through it, 0.11 - 0.34) is wrapped until then and
unwrapped once the line is out. The wrapper only logs; a vLLM without that
function keeps its logging as it is, and the line stays held.
"""

from __future__ import annotations

import logging
import sys
import threading
from types import ModuleType
from typing import Any

import wrapt

VLLM_LOGGER_MODULE = "vllm.logger"
CONFIGURE = "_configure_vllm_root_logger"

# Under vLLM's logger namespace, so vLLM's handlers and levels apply.
logger = logging.getLogger("vllm.kvfill_patch")

_lock = threading.RLock()
_held: tuple[int, str, tuple] | None = None
"""The line waiting for vLLM's logging: level, message, arguments."""
_wrapper: Any = None
"""Ours on vLLM's configuration function while a line is held."""


def log(level: int, message: str, *args: Any) -> None:
    """Log now where the line would be emitted, else when vLLM configures its
    logging (a later line replaces a held one: the newest decision counts).
    Never raises."""
    global _held
    with _lock:
        if logger.isEnabledFor(level):
            _held = None
            logger.log(level, message, *args)
            return
        _held = (level, message, args)
        if _wrapper is not None:
            return
    try:
        # Fires at once where vllm.logger is imported (always, once vLLM is).
        wrapt.register_post_import_hook(_wrap_configure, VLLM_LOGGER_MODULE)
    except Exception:  # noqa: BLE001 - the line stays held, nothing breaks
        pass


def _wrap_configure(module: ModuleType) -> None:
    """The post-import hook. Must not raise: wrapt would fail vLLM's import."""
    global _wrapper
    with _lock:
        try:
            if _wrapper is None and callable(getattr(module, CONFIGURE, None)):
                _wrapper = wrapt.wrap_function_wrapper(
                    module, CONFIGURE, _log_held_after
                )
        except Exception:  # noqa: BLE001 - see above
            _wrapper = None


def _log_held_after(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    result = wrapped(*args, **kwargs)
    global _held, _wrapper
    with _lock:
        try:
            held, _held = _held, None
            if held is not None:
                level, message, line_args = held
                logger.log(level, message, *line_args)
            module = sys.modules.get(VLLM_LOGGER_MODULE)
            wrapt.unwrap_object(module, CONFIGURE, _wrapper, missing_ok=True)
            _wrapper = None
        except Exception:  # noqa: BLE001 - kept (another wrapper above ours)
            pass
    return result
