"""Elementwise steps compiled by torch.compile with only the token axis symbolic, shared by the extraction path
(engines/fast.py) and the training loss (train.py)."""

from __future__ import annotations

import functools

import torch


def token_axis_dynamic(step, backend, tensors: int):
    """step compiled with only the token axis (dim 0 of its first `tensors` arguments) symbolic: every other size
    and stride is a constant in the generated code, so its loads vectorize and its index math has no division by a
    runtime value (with every size symbolic, dynamic=True, the rotation and SiLU x up ran at a fraction of the memory
    bandwidth). A call site with other static sizes (q and k heads, another model) compiles its own entry once.
    fullgraph: a step that cannot be traced whole fails at its first call instead of running half eager."""
    compiled = torch.compile(step, backend=backend, dynamic=False, fullgraph=True)

    @functools.wraps(step)
    def run(*args):
        for t in args[:tensors]:
            torch._dynamo.maybe_mark_dynamic(t, 0)  # "maybe": a one-token batch may specialise, not fail
        return compiled(*args)
    return run


def can_compile(device: torch.device) -> bool:
    """torch.compile's inductor backend generates code for this device: CUDA with triton importable."""
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
