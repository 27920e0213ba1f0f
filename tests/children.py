"""Code that runs in a fresh interpreter (``helpers.run_fresh``), one function
per scenario, each returning a JSON-able report.

Nothing here is imported at module level beyond the standard library: what a
scenario imports, and when, is the scenario.
"""

from __future__ import annotations

import functools
import gc
import importlib
import importlib.util
import math
import multiprocessing
import os
import sys

CONNECTOR_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.decode_bench_connector"
CONNECTOR_METHODS = (
    "DecodeBenchConnector.__init__",
    "DecodeBenchConnector.start_load_kv",
    "DecodeBenchConnectorWorker.start_fill_kv",
    "DecodeBenchConnectorWorker._fill_blocks",
    "DecodeBenchConnectorScheduler.get_num_new_matched_tokens",
    "DecodeBenchConnectorScheduler.update_state_after_alloc",
    "DecodeBenchConnector.update_state_after_alloc",
)
"""The methods a connector's construction, a step and a scheduling go
through; the overlay wraps some (``helpers.wrappers_for``), never the
worker's."""


def wrapper_count(function) -> int:
    """How many wrappers (wrapt or functools.wraps) sit on `function`."""
    import wrapt

    return len(list(wrapt.wrapper_chain(function))) - 1


def connector_report(module=None) -> dict:
    """Wrappers on the patched methods, and the package's status if loaded."""
    module = module or sys.modules.get(CONNECTOR_MODULE)
    report: dict = {"connector": module is not None}
    # vLLM 0.31+ configures its logging only when an engine or the CLI starts.
    report["vllm_logging_configured_late"] = LOGGING_CONFIGURED_BEFORE == [False]
    vllm_logger = sys.modules.get("vllm.logger")
    if vllm_logger is not None:
        configure = vllm_logger._configure_vllm_root_logger
        report["logging_configuration_wrappers"] = wrapper_count(configure)
    if module is not None:
        report["wrappers"] = {
            path: wrapper_count(
                getattr(module, path.split(".")[0]).__dict__[path.split(".")[1]]
            )
            for path in CONNECTOR_METHODS
        }
    package = sys.modules.get("vllm_kvfill_patch")
    if package is not None:
        current = package.status()
        report["status"] = {
            "decision": current.decision.value,
            "reason": current.reason,
            "version": current.vllm_version,
            "parts": list(current.parts),
        }
    return report


def _import_connector() -> None:
    importlib.import_module(CONNECTOR_MODULE)


LOGGING_CONFIGURED_BEFORE: list[bool] = []
"""Whether vLLM's logging was configured when `_configure_vllm_logging` ran."""


def _configure_vllm_logging() -> None:
    """As an engine or the CLI does when it starts, from 0.31 (vLLM up to 0.30
    configured its logging when imported)."""
    import logging

    import vllm.logger

    LOGGING_CONFIGURED_BEFORE.append(bool(logging.getLogger("vllm").handlers))
    if hasattr(vllm.logger, "configure_logging"):
        from vllm.config import LoggingConfig

        vllm.logger.configure_logging(LoggingConfig())


def _load_plugins() -> None:
    import vllm.plugins

    vllm.plugins.load_general_plugins()


STEPS = {
    "import package": lambda: importlib.import_module("vllm_kvfill_patch"),
    "import vllm": lambda: importlib.import_module("vllm"),
    "import connector": _import_connector,
    "apply": lambda: importlib.import_module("vllm_kvfill_patch").apply(),
    "revert": lambda: importlib.import_module("vllm_kvfill_patch").revert(),
    "load plugins": _load_plugins,
    "set kill switch": lambda: os.environ.__setitem__("KVFILL_PATCH_DISABLE", "yes"),
    "configure logging": _configure_vllm_logging,
}


def run_steps(steps: list[str]) -> dict:
    """Run the named STEPS in order, then report."""
    for step in steps:
        STEPS[step]()
    return connector_report()


def modules_loaded_by_importing_the_package() -> dict:
    import vllm_kvfill_patch

    loaded = sorted(m for m in ("vllm", "torch", "wrapt") if m in sys.modules)
    return {"loaded": loaded, "decision": vllm_kvfill_patch.status().decision.value}


def status_command() -> dict:
    """`python -m vllm_kvfill_patch`: the package's __main__ run as that
    command runs it (what it prints is the child's stdout)."""
    import runpy

    sys.argv = ["vllm_kvfill_patch"]
    try:
        runpy.run_module("vllm_kvfill_patch", run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        return {"exitcode": exit_.code}
    return {"exitcode": None}


def _plugins_in_a_spawned_child(queue) -> None:
    import wrapt  # noqa: F401 - as a worker has it, before the plugins

    before = "vllm_kvfill_patch" in sys.modules
    _load_plugins()
    report = connector_report(importlib.import_module(CONNECTOR_MODULE))
    queue.put({**report, "imported_before_plugins": before})
    gc.freeze()  # an exit without collecting what vLLM allocated: 2 s here


def spawned_child_report() -> dict:
    """A child started with `spawn` (as vLLM's CLI starts them) loads plugins."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_plugins_in_a_spawned_child, args=(queue,))
    process.start()
    report = queue.get(timeout=240)
    process.join(60)
    report["exitcode"] = process.exitcode
    report["parent_imported"] = "vllm_kvfill_patch" in sys.modules
    return report


# Targets the package does not know: replacement _fill_blocks of other shapes.


def _fill_blocks_changed_signature(self, group_idx, block_ids):
    pass


def _fill_blocks_writes_nothing(self, group_idx, block_ids, num_tokens):
    pass


def _fill_blocks_raises_otherwise(self, group_idx, block_ids, num_tokens):
    raise KeyError("layout")


UNKNOWN_TARGETS = {
    "changed-signature": _fill_blocks_changed_signature,
    "writes-nothing": _fill_blocks_writes_nothing,
    "raises-otherwise": _fill_blocks_raises_otherwise,
}


def unknown_target_report(target: str) -> dict:
    """The connector's _fill_blocks replaced before the package's hook runs."""
    import wrapt

    def change_target(module) -> None:
        module.DecodeBenchConnectorWorker._fill_blocks = UNKNOWN_TARGETS[target]

    # Registered first, so it runs before the package's own hook.
    wrapt.register_post_import_hook(change_target, CONNECTOR_MODULE)
    import vllm_kvfill_patch  # noqa: F401

    _import_connector()
    return connector_report()


def failing_hook_report() -> dict:
    """The gating raises inside the hook; both imports of vLLM still succeed."""
    from vllm_kvfill_patch import installer

    def broken(*args):
        raise RuntimeError("boom")

    installer.judge = broken
    _import_connector()
    _import_connector()
    return connector_report()


# Other patches on the same methods.


def _plain_monkeypatch(owner, name: str) -> None:
    """What profilers do: a functools.wraps closure set on the class."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def traced(*args, **kwargs):
        traced.calls += 1
        return original(*args, **kwargs)

    traced.calls = 0
    setattr(owner, name, traced)


def _closure_without_wrapped(owner, name: str) -> None:
    """A closure that hides what it wraps (no functools.wraps), and so its
    signature too."""
    original = getattr(owner, name)

    def traced(self, *args, **kwargs):
        return original(self, *args, **kwargs)

    setattr(owner, name, traced)


def _wrapt_wrapper(owner, name: str) -> None:
    import wrapt

    wrapt.wrap_function_wrapper(owner, name, lambda w, i, a, k: w(*a, **k))


def _replace_outright(owner, name: str) -> None:
    """Set upstream's own function back by hand, over our wrapper."""
    setattr(owner, name, owner.__dict__[name].__wrapped__)


FOREIGN_PATCHES = {
    "plain monkeypatch": _plain_monkeypatch,
    "closure without __wrapped__": _closure_without_wrapped,
    "wrapt wrapper": _wrapt_wrapper,
    "replaced outright": _replace_outright,
    "none": None,
}


def step_behaviour() -> str:
    """What the connector's step (``start_load_kv``) does to a list state
    cache right now: 'patched' (block rows only), 'upstream crash' or
    'upstream whole'."""
    import torch

    module = sys.modules[CONNECTOR_MODULE]
    worker = object.__new__(module.DecodeBenchConnectorWorker)
    state = torch.zeros(8, 2)
    worker.kv_caches = {"layer": [state]}
    worker.group_to_layers = {0: ["layer"]}
    worker.fill_mean, worker.fill_std = 1.0, 0.0
    worker._zero_fill_group_ids, worker._fp8_dtypes = set(), {}  # read from 0.30
    worker.vllm_config = _config_with_blocks(8)
    connector = object.__new__(module.DecodeBenchConnector)
    connector.connector_worker = worker
    connector._vllm_config, connector._kv_cache_config = worker.vllm_config, None
    connector._connector_metadata = module.DecodeBenchConnectorMetadata(
        reqs_to_fill={"r": (([3],), 16)}
    )
    try:
        connector.start_load_kv(None)
    except AttributeError:
        return "upstream crash"
    rows = state.ne(0).any(dim=1).nonzero().flatten().tolist()
    return "patched" if rows == [3] else "upstream whole"


def refill_behaviour() -> str:
    """What the scheduler side answers right now for a preempted request it
    filled before: 'refill' (all 8 tokens but the last are matched) or
    'upstream' (none: vLLM prefills it)."""
    from vllm_kvfill_patch.gating import preempted_after_a_fill

    scheduler_cls = sys.modules[CONNECTOR_MODULE].DecodeBenchConnectorScheduler
    scheduler, request = preempted_after_a_fill(scheduler_cls)
    matched, _ = scheduler_cls.get_num_new_matched_tokens(scheduler, request, 0)
    return {7: "refill", 0: "upstream"}.get(matched, f"{matched} matched")


def semantics_report(steps: list[str]) -> dict:
    """`run_steps`, then what the scheduler side does with a preempted request
    and with a one-token prompt back after a preemption."""
    report = run_steps(steps)
    report["refill"] = refill_behaviour()
    report["zero-token"] = zero_token_behaviour()
    return report


def zero_token_behaviour() -> str:
    """What the scheduler side does right now with a one-token prompt back
    after a preemption: 'not offered' (filled once) or 'offered' (its 3
    generated tokens, as external KV: upstream's, or the refill's)."""
    from vllm_kvfill_patch.gating import bare_scheduler, offered_after_a_zero_token_fill

    cls = sys.modules[CONNECTOR_MODULE].DecodeBenchConnectorScheduler
    offered = offered_after_a_zero_token_fill(
        bare_scheduler(cls),
        cls.get_num_new_matched_tokens,
        cls.update_state_after_alloc,
    )
    return {0: "not offered", 3: "offered"}.get(offered, f"{offered} offered")


def _config_with_blocks(num_blocks: int):
    from types import SimpleNamespace

    cache_config = SimpleNamespace(num_gpu_blocks=num_blocks, cache_dtype="auto")
    return SimpleNamespace(cache_config=cache_config)


def foreign_patch_report(
    foreign: str, steps: list[str], target: str = "DecodeBenchConnector.start_load_kv"
) -> dict:
    """Ours applied, another patch put above it on `target`, then `steps`;
    never raises?"""
    import vllm_kvfill_patch

    _import_connector()
    module = sys.modules[CONNECTOR_MODULE]
    owner, _, name = target.rpartition(".")
    if FOREIGN_PATCHES[foreign] is not None:
        FOREIGN_PATCHES[foreign](getattr(module, owner), name)
    report: dict = {"raised": None, "after": []}
    try:
        for step in steps:
            STEPS[step]()
            report["after"].append(
                {
                    "step": step,
                    "decision": vllm_kvfill_patch.status().decision.value,
                    "reason": vllm_kvfill_patch.status().reason,
                    "behaviour": step_behaviour(),
                    "refill": refill_behaviour(),
                    "zero-token": zero_token_behaviour(),
                }
            )
    except Exception as exc:  # noqa: BLE001 - the report says what raised
        report["raised"] = f"{type(exc).__name__}: {exc}"
    return report


def load_connector_file(path: str):
    """Load `path` as vLLM's connector module, in place of the installed one.

    vLLM's connector package imports the original while it loads, so it is
    loaded first and the module is then swapped in sys.modules and on the
    package, where both ``import`` forms and vLLM's factory look it up.
    """
    parent_name, _, child = CONNECTOR_MODULE.rpartition(".")
    parent = importlib.import_module(parent_name)
    spec = importlib.util.spec_from_file_location(CONNECTOR_MODULE, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[CONNECTOR_MODULE] = module
    setattr(parent, child, module)
    return module


def patched_file_report(path: str) -> dict:
    """The package's decision on a connector file with a patches/ file applied."""
    import vllm_kvfill_patch

    # Loading the original first patches it; what counts is the decision on
    # the patched file, re-taken by apply() once it is in place.
    vllm_kvfill_patch.revert()
    module = load_connector_file(path)
    vllm_kvfill_patch.apply()
    return connector_report(module)


def bench_tables(arguments: list[str]) -> dict:
    """``python -m tools.bench`` with `arguments` (its tables are the
    child's stdout); the row names it measured, for the test to match."""
    from tools import bench, step_rig

    bench.main(arguments)
    state_bytes = sum(math.prod(shape) * 4 for shape in bench.STEP_STATES)
    per_layer_slot = (
        step_rig.ATTENTION_BLOCKS * bench.STEP_PAGE_BYTES
        + step_rig.LINEAR_GROUPS * step_rig.STATE_BLOCKS * state_bytes
    )
    return {
        "cases": [case.name for case in bench.cases()],
        "written_bytes_per_request": step_rig.LAYERS_PER_GROUP * per_layer_slot,
    }


def package_location() -> dict:
    import vllm_kvfill_patch

    return {"file": vllm_kvfill_patch.__file__}


class _FrozenImports:
    """A pytest plugin: what collection imported is out of the collector's reach."""

    @staticmethod
    def pytest_collection_finish() -> None:
        gc.freeze()


def pytest_in(tree: str, arguments: list[str]) -> dict:
    """pytest in `tree` (vLLM's source tree, on its sources, or this project's
    root), as a new pytest process would run it.

    The ``tests`` modules this process inherited are dropped, so the tree's
    own are imported afresh (upstream's conftest and test modules, or this
    project's conftest reading the environment the child was given).
    """
    import pytest

    for name in [m for m in sys.modules if m == "tests" or m.startswith("tests.")]:
        del sys.modules[name]
    # Upstream's teardown after every test (cleanup_dist_env_and_memory)
    # unfreezes the heap before it collects. Here the frozen part is the
    # zygote's preload, and, once collected, the tree's own modules: imports,
    # never garbage, whose full collection cost 0.5 s a test (38 tests after
    # each of 5 commits). What the tests create is still collected.
    gc.unfreeze = lambda: None
    os.chdir(tree)
    sys.path.insert(0, tree)
    exitcode = int(
        pytest.main(["-p", "no:cacheprovider", *arguments], plugins=[_FrozenImports])
    )
    vllm = sys.modules.get("vllm")
    return {"exitcode": exitcode, "vllm": getattr(vllm, "__file__", None)}
