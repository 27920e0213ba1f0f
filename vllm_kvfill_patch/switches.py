"""The environment switches, read where they are needed (each process reads
its own environment: vLLM's processes inherit it, Ray's workers take it from
``ray start``'s).

- ``KVFILL_PATCH_DISABLE=1`` leaves vLLM untouched.
- ``KVFILL_PATCH_REFILL=1`` fills a preempted request again, in every
  connector of the process (a decode node with an offload tier); ``0`` leaves
  the refill out, even where a connector's options ask for it; unset, each
  connector's ``refill_preempted`` option decides (off by default).
"""

from __future__ import annotations

import os

KILL_SWITCH = "KVFILL_PATCH_DISABLE"
REFILL_SWITCH = "KVFILL_PATCH_REFILL"

_ON = ("1", "true", "yes")
_OFF = ("0", "false", "no")


def kill_switch_on() -> bool:
    """Whether ``KVFILL_PATCH_DISABLE`` is set to anything but off."""
    return _value(KILL_SWITCH) not in ("", *_OFF)


def refill_switch() -> bool | None:
    """``KVFILL_PATCH_REFILL``: True (on), False (off), None (unset, or a
    value that is neither: the connector's option decides)."""
    value = _value(REFILL_SWITCH)
    if value in _ON:
        return True
    if value in _OFF:
        return False
    return None


def refill_switch_unknown() -> str | None:
    """The value of ``KVFILL_PATCH_REFILL`` if it is set to neither on nor off."""
    value = _value(REFILL_SWITCH)
    return None if value in ("", *_ON, *_OFF) else os.environ[REFILL_SWITCH]


def _value(name: str) -> str:
    return os.environ.get(name, "").strip().lower()
