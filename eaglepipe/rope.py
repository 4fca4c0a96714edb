"""Rotary position embeddings of the draft: plain, linear, llama3 and yarn rope, from the rope keys of a config.json.

The draft's config.json carries the target's rope keys verbatim, and vLLM (LlamaForCausalLMEagle3 -> LlamaAttention ->
get_rope) and SGLang build the served draft's rope from them; the trainer must rope exactly as they do. The semantics
here are vLLM's (>= 0.32, the engine this pipeline benches) and transformers' (5.x), which agree for every key handled:
tests/test_rope.py checks them against vLLM's own get_rope numerically.

Yarn magnitude, the trap: DeepSeek-V3 / Kimi-K2 configs carry mscale and mscale_all_dim. vLLM's and transformers'
"yarn" then scale cos/sin by get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim), which is 1.0 for Kimi's
keys (both 1.0); without those keys they scale by get_mscale(factor) = 1 + 0.1 ln(factor) (1.347 at factor 32).
Older engines disagree: vLLM before the mscale keys were honoured in its yarn (it used get_mscale(factor) * attn_factor)
and SGLang releases before the same fix serve Kimi's keys at 1.347, so a draft trained here would see differently scaled
attention logits there. Current SGLang honours mscale/mscale_all_dim when both are present (not None; vLLM and
transformers need both non-zero, which differs only when one of them is 0). Keys SGLang applies but vLLM ignores
(attn_factor, extrapolation_factor) are refused below rather than guessed; attention_factor, which vLLM and
transformers apply and SGLang ignores, is followed as vLLM does (no published target of ours sets it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

# config.json keys that hold rope settings (Phi-3 style configs keep original_max_position_embeddings at the top)
KEYS = ("rope_theta", "rope_scaling", "rope_parameters", "original_max_position_embeddings")
REQUIRED = {"linear": {"factor"}, "yarn": {"factor", "original_max_position_embeddings"},
            "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}}
SUPPORTED = {
    "default": set(),
    "linear": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
             "attention_factor", "truncate"},
}
NEUTRAL = {"rope_type", "rope_theta", "partial_rotary_factor"}  # partial_rotary_factor: checked to be 1 below


def parameters(config: dict) -> dict:
    """The rope settings that change positions, whichever keys (rope_theta, rope_scaling, rope_parameters) hold them."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    params["rope_theta"] = float(params["rope_theta"])
    legacy = params.pop("type", None)
    params.setdefault("rope_type", legacy or "default")
    if params["rope_type"] in ("llama3", "yarn"):
        # As transformers' standardisation (which vLLM's config loader runs) fills it: the top-level key first, else
        # the rope's own, else max_position_embeddings.
        original = config.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
        original = original or config.get("max_position_embeddings")
        if original is not None:
            params["original_max_position_embeddings"] = original
    return params


@dataclass
class Rope:
    """Per-pair inverse frequencies [d/2], the magnitude that multiplies cos and sin, and the divisor of positions
    (linear scaling; applied to positions rather than frequencies so the fp32 angles round as vLLM's do)."""
    inv_freq: torch.Tensor
    magnitude: float = 1.0
    position_divisor: float = 1.0
    # fp32 copies per device: kept out of the module's buffers so model.to(bfloat16) cannot round the frequencies.
    on_device: dict = field(default_factory=dict, repr=False)

    def angles(self, positions: torch.Tensor, device) -> torch.Tensor:
        """Rotation angles [..., d/2] (fp32) at integer positions [...]."""
        t = positions[..., None].float()
        if self.position_divisor != 1.0:
            t = t / self.position_divisor
        if device not in self.on_device:
            self.on_device[device] = self.inv_freq.to(device)
        return t * self.on_device[device]


def rotate_half(x: torch.Tensor, angles: torch.Tensor, magnitude: float) -> torch.Tensor:
    """x [..., d] rotated by angles [..., d/2] (Rope.angles, broadcast against x's leading axes; Llama's rotate-half,
    "neox" layout), computed in fp32, returned in x's dtype: the draft's rotation, eager or compiled."""
    d = x.shape[-1]
    cos = torch.cat([angles.cos()] * 2, -1) * magnitude
    sin = torch.cat([angles.sin()] * 2, -1) * magnitude
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return (x * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)


def get_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature: 1 + 0.1 * mscale * ln(factor), 1 when the factor does not stretch."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def build(config: dict, head_dim: int) -> Rope:
    """The rope a Llama-style layer with this config.json rope keys applies; clear error for unsupported settings."""
    p = parameters(config)
    kind = p["rope_type"]
    if kind not in SUPPORTED:
        raise NotImplementedError(f"rope type {kind!r} (rope settings {p}): the draft trainer supports "
                                  f"{sorted(SUPPORTED)}; add it to eaglepipe/rope.py with a test against vLLM's "
                                  "get_rope")
    unknown = set(p) - NEUTRAL - SUPPORTED[kind]
    if unknown or float(p.get("partial_rotary_factor", 1.0)) != 1.0:
        raise NotImplementedError(f"rope type {kind!r} with keys {sorted(unknown) or ['partial_rotary_factor']} "
                                  f"(rope settings {p}): the draft trainer does not model them, and serving engines "
                                  "differ on some; add them to eaglepipe/rope.py with a test against vLLM's get_rope")
    missing = REQUIRED.get(kind, set()) - set(p)
    if missing:
        raise ValueError(f"rope settings {p}: rope type {kind!r} needs {sorted(missing)}; fix the target's "
                         "config.json (rope_scaling or rope_parameters)")
    theta = p["rope_theta"]
    # Plain rope: inv_freq_i = 1 / theta^(2i/d), i = 0 .. d/2-1.
    denominators = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    if kind == "default":
        return Rope(1.0 / denominators)
    if kind == "linear":  # positions divided by factor
        return Rope(1.0 / denominators, position_divisor=float(p["factor"]))
    if kind == "llama3":
        return Rope(_llama3(1.0 / denominators, p))
    return _yarn(denominators, p, head_dim)


def _llama3(base: torch.Tensor, p: dict) -> torch.Tensor:
    """Llama 3.1 scaling by wavelength: short waves kept, long ones divided by factor, smooth blend between."""
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    original = p["original_max_position_embeddings"]
    wavelength = 2 * math.pi / base
    smooth = (original / wavelength - low) / (high - low) if low != high else torch.zeros_like(base)
    blended = (1 - smooth) * base / factor + smooth * base
    return torch.where(wavelength < original / high, base,
                       torch.where(wavelength > original / low, base / factor, blended))


def _yarn(denominators: torch.Tensor, p: dict, head_dim: int) -> Rope:
    """YaRN (Peng et al. 2023, "NTK-by-parts"): pair i keeps its frequency where it turns more than beta_fast times
    over the original context, is divided by factor where it turns fewer than beta_slow times, with a linear ramp in i
    between the two (bounds floor/ceil'd unless truncate is false); cos and sin are multiplied by the magnitude."""
    factor, original, theta = p["factor"], p["original_max_position_embeddings"], p["rope_theta"]
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def pair_of(rotations: float) -> float:  # the pair index that turns `rotations` times over `original` positions
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair_of(beta_fast), pair_of(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a step instead of a ramp (Kimi-K2's beta_fast = beta_slow = 1)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate (divide by factor)
    inv_freq = 1.0 / (factor * denominators) * (1 - keep) + 1.0 / denominators * keep
    if p.get("attention_factor") is not None:
        magnitude = float(p["attention_factor"])
    elif p.get("mscale") and p.get("mscale_all_dim"):
        magnitude = get_mscale(factor, p["mscale"]) / get_mscale(factor, p["mscale_all_dim"])
    else:
        magnitude = get_mscale(factor)
    return Rope(inv_freq, magnitude)
