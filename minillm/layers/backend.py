"""Which code a layer runs: minillm's Triton kernels or their plain-PyTorch references.

The choice is made here and nowhere else. `auto` (the default) runs the Triton kernels of
`minillm.kernels` on CUDA tensors and the references on a CPU; `torch` forces the references
everywhere (the oracle the kernels are tested against, on the same GPU); `triton` forces the kernels
everywhere, which on a CPU means Triton's interpreter (`TRITON_INTERPRET=1`, slow, small shapes).

    MINILLM_KERNELS=torch minillm generate "..."      # or, in Python:
    with kernel_mode("torch"): llm.generate(...)
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch

MODES = ("auto", "triton", "torch")


def _checked(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"kernel mode (MINILLM_KERNELS) must be one of {', '.join(MODES)}, not {mode!r}")
    return mode


_mode = _checked(os.environ.get("MINILLM_KERNELS", "auto"))


def get_kernel_mode() -> str:
    return _mode


def set_kernel_mode(mode: str) -> None:
    global _mode
    _mode = _checked(mode)


@contextmanager
def kernel_mode(mode: str):
    """Run a block with another kernel mode, then restore the previous one."""
    before = get_kernel_mode()
    set_kernel_mode(mode)
    try:
        yield
    finally:
        set_kernel_mode(before)


def use_triton(x: torch.Tensor) -> bool:
    """True if the op on tensor `x` should run minillm's Triton kernel."""
    if _mode == "torch":
        return False
    if x.is_cuda:
        return True
    if _mode == "triton":
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("kernel mode 'triton' on a CPU tensor needs Triton's interpreter: set "
                             "TRITON_INTERPRET=1 before minillm is imported (or use a CUDA device)")
        return True
    return False
