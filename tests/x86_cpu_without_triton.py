"""Imported at the start of every interpreter of a session whose vLLM refuses
x86 CPUs without Triton (noxfile.install_startup_module; from 0.34).

From 0.34 vLLM's CPU platform runs its x86 model runner on triton-cpu, and
``CpuPlatform.check_and_update_config`` raises "vLLM on x86 CPUs requires
Triton (triton-cpu)" where ``vllm.triton_utils.HAS_TRITON`` is false, so no
``VllmConfig`` can be built. No package index carries triton-cpu. The tests
of these sessions build configs, KV caches and connectors and run no model
and no kernel: the check runs here as if Triton were installed, and only the
check (``HAS_TRITON`` is true for the length of that call, and the rest of
vLLM sees its own value).
The standard library only, and nothing imported before that module is: the
test process's zygote must start before vLLM and wrapt are imported.
"""

import importlib.abc
import importlib.machinery
import sys

MODULE = "vllm.platforms.cpu"


def as_if_triton_is_installed(check):
    def check_and_update_config(cls, vllm_config):
        import vllm.triton_utils as triton_utils

        has_triton = triton_utils.HAS_TRITON
        triton_utils.HAS_TRITON = True
        try:
            return check(cls, vllm_config)
        finally:
            triton_utils.HAS_TRITON = has_triton

    return classmethod(check_and_update_config)


class CheckAsIfTritonOnLoad(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_replace(module):
            exec_module(module)
            platform = module.CpuPlatform
            check = platform.__dict__["check_and_update_config"].__func__
            platform.check_and_update_config = as_if_triton_is_installed(check)

        spec.loader.exec_module = exec_and_replace
        return spec


sys.meta_path.insert(0, CheckAsIfTritonOnLoad())
