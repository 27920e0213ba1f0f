"""A process forked from pytest's own, which forks the tests' fresh processes
(``helpers.run_forked``: the scenarios of children.py, the engine probes).

It is forked once pytest has imported the heavy third-party modules vLLM
needs (PRELOADED), and before anything imports vLLM, wrapt or this package
(NEVER_PRELOADED). A child then starts with those modules loaded and none of
its scenario's: it imports the connector in about a second, and the session
pays for PRELOADED once, in the pytest process, which needs them anyway to
build its VllmConfig (a fork server of its own imported them again: ~9 s a
session).
"""

from __future__ import annotations

import gc
import importlib
import importlib.util
import multiprocessing
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection

PRELOADED = [
    "torch",
    "torch._dynamo",
    "torch._inductor.lowering",
    "torch._inductor.compile_fx",
    "torch.distributed.checkpoint",
    "transformers",
    "transformers.modeling_utils",
    "transformers.processing_utils",
    "transformers.models.auto",
    "transformers.modeling_gguf_pytorch_utils",
    "transformers.tokenization_mistral_common",
    "openai_harmony",
    "cv2",
    "llguidance",
    "cpuinfo",
    "openai",
    "aiohttp",
    "pydantic",
    "fastapi",
    "xgrammar",
    "setuptools",
    "requests",
    "zmq",
    "prometheus_client",
    "psutil",
    "msgspec",
    "tokenizers",
]
"""The third-party modules that are most of vLLM's import time: what building
a VllmConfig imports, and what a child's scenario then would (vLLM's request
and structured-output modules: Mistral's tokenizer, harmony, OpenCV; 0.4 s of
a child's 1.2 s on 0.26). One a release lacks is skipped."""
NEVER_PRELOADED = ("vllm", "wrapt", "vllm_kvfill_patch")
"""Whose import order is what the scenarios are about (each child checks)."""

_requests: Connection | None = None
_zygote: multiprocessing.process.BaseProcess | None = None


def start() -> None:
    """Import PRELOADED here and fork the zygote; nothing without a vLLM."""
    global _requests, _zygote
    loaded = [m for m in NEVER_PRELOADED if m in sys.modules]
    if loaded:
        raise RuntimeError(f"the zygote must start before {loaded} is imported")
    if importlib.util.find_spec("vllm") is None:
        return
    # Imports make objects that live as long as the process: collecting
    # while they load only walks them again and again (1 - 2 s a session).
    gc.disable()
    try:
        for module in PRELOADED:
            try:
                importlib.import_module(module)
            except ImportError:
                pass
        # Out of the collector's reach from here on, in pytest and every
        # forked process: a child's full collections no longer walk all of
        # torch's and transformers' objects (its connector import: 0.9 -> 0.6 s).
        gc.freeze()
    finally:
        gc.enable()
    fork = multiprocessing.get_context("fork")
    _requests, zygote_end = fork.Pipe()
    _zygote = fork.Process(target=_serve, args=(zygote_end,), name="zygote")
    _zygote.start()
    zygote_end.close()


def stop() -> None:
    """Close the request pipe; the zygote exits at its end."""
    global _requests, _zygote
    if _requests is not None:
        _requests.close()
        _zygote.join()
    _requests = _zygote = None


def run(target: Callable, args: tuple, timeout: float) -> int:
    """Run `target(*args)` in a child forked from the zygote; its exit code
    (-9 if it ran past `timeout` seconds and was killed)."""
    if _requests is None:
        raise RuntimeError(
            "no zygote: tests/conftest.py starts it when vLLM is installed"
        )
    _requests.send((target, args, timeout))
    try:
        return _requests.recv()
    except EOFError:
        raise RuntimeError(f"the zygote (pid {_zygote.pid}) died") from None


def _serve(requests: Connection) -> None:
    """The zygote: one child per request, one at a time, until pytest's end
    of the pipe closes."""
    if _requests is not None:
        _requests.close()  # pytest's end: the zygote sees EOF when pytest closes it
    fork = multiprocessing.get_context("fork")
    while True:
        try:
            target, args, timeout = requests.recv()
        except EOFError:
            return
        child = fork.Process(target=target, args=args)
        child.start()
        child.join(timeout)
        if child.is_alive():
            child.kill()
            child.join()
        requests.send(child.exitcode)
