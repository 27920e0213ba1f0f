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
"""

from _kvfill_on_load import change_on_load


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


def check_as_if_triton(module):
    platform = module.CpuPlatform
    check = platform.__dict__["check_and_update_config"].__func__
    platform.check_and_update_config = as_if_triton_is_installed(check)


change_on_load("vllm.platforms.cpu", check_as_if_triton)
