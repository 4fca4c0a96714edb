"""The EAGLE-3 draft: one Llama-style decoder layer over fused target hidden states, in plain PyTorch.

Parameter names equal the serving checkpoint's (REFERENCE section 4), so the state dict is the checkpoint:
    fc.weight [H, 3*Ht]; midlayer.self_attn.{q,k,v}_proj.weight [*, 2H]; midlayer.self_attn.o_proj.weight;
    midlayer.mlp.{gate,up,down}_proj.weight; midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight;
    norm.weight; lm_head.weight [Vd, H]; d2t int64 [Vd]; t2d bool [V].
The forward pass follows vLLM's Eagle-3 Llama layer: the embedding and the hidden state are normed separately and
concatenated for attention; the pre-norm output is what the next unroll step receives as its hidden state.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from .formats import atomic_path
from .rope import KEYS as ROPE_KEYS
from .rope import build as build_rope
from .rope import parameters as rope_parameters


@dataclass
class DraftConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    aux_layer_ids: list[int]
    rope_theta: float = 10000.0
    # The target's own rope keys, copied verbatim into config.json so the engine ropes like the target; the trainer
    # ropes from the same keys (eaglepipe/rope.py), so training and serving agree.
    target_rope: dict = field(default_factory=dict)

    @property
    def rope_settings(self) -> dict:
        """The keys the rope is built from: the target's, or plain rope at rope_theta for a config without them."""
        return {"max_position_embeddings": self.max_position_embeddings,
                **(self.target_rope or {"rope_theta": self.rope_theta})}

    @classmethod
    def from_target(cls, target: dict, *, draft_vocab_size: int, aux_layer_ids: list[int]) -> "DraftConfig":
        rope = {k: target[k] for k in ROPE_KEYS if k in target}
        heads = target["num_attention_heads"]
        head_dim = target.get("head_dim") or target["hidden_size"] // heads
        positions = target.get("max_position_embeddings", 4096)
        # Fails here, naming the rope type, when the trainer cannot rope like the engines.
        build_rope({**rope, "max_position_embeddings": positions}, head_dim)
        return cls(
            hidden_size=target["hidden_size"], intermediate_size=target["intermediate_size"],
            num_attention_heads=heads, num_key_value_heads=target.get("num_key_value_heads", heads),
            head_dim=head_dim,
            vocab_size=target["vocab_size"], draft_vocab_size=draft_vocab_size,
            target_hidden_size=target["hidden_size"],
            max_position_embeddings=positions,
            rms_norm_eps=target.get("rms_norm_eps", 1e-6), aux_layer_ids=list(aux_layer_ids),
            rope_theta=rope_parameters(rope)["rope_theta"], target_rope=rope,
        )

    def to_hf(self) -> dict:
        """config.json in the form vLLM and SGLang load (REFERENCE section 4)."""
        return {
            "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "num_hidden_layers": 1, "hidden_act": "silu",
            "vocab_size": self.vocab_size, "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size, "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": self.aux_layer_ids, "use_aux_hidden_state": True},
            "eaglepipe": {"layer_convention": "input_of_layer", "rope_theta": self.rope_theta},
            **self.target_rope,
        }

    @classmethod
    def from_hf(cls, hf: dict) -> "DraftConfig":
        rope = {k: hf[k] for k in ROPE_KEYS if k in hf}
        return cls(
            hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
            num_attention_heads=hf["num_attention_heads"], num_key_value_heads=hf["num_key_value_heads"],
            head_dim=hf["head_dim"], vocab_size=hf["vocab_size"], draft_vocab_size=hf["draft_vocab_size"],
            target_hidden_size=hf["target_hidden_size"], max_position_embeddings=hf["max_position_embeddings"],
            rms_norm_eps=hf["rms_norm_eps"], aux_layer_ids=hf["eagle_config"]["eagle_aux_hidden_state_layer_ids"],
            rope_theta=hf["eaglepipe"]["rope_theta"], target_rope=rope,
        )


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class Attention(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.rope = build_rope(c.rope_settings, c.head_dim)

    def forward(self, x, positions, mask, cache: list) -> torch.Tensor:
        """x [B, T, 2H]; mask [B, T, T] (True = may attend) for the context entries, cache[0];
        entries of later unroll steps (cache[1:]) are attended only at their own position (the diagonal)."""
        b, t, _ = x.shape
        c = self.c
        q = self.q_proj(x).view(b, t, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        q, k = self.rope.rotate(q, positions), self.rope.rotate(k, positions)
        groups = c.num_attention_heads // c.num_key_value_heads
        cache.append((k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)))
        scale = 1.0 / math.sqrt(c.head_dim)
        k0, v0 = cache[0]
        scores = (q @ k0.transpose(-1, -2)) * scale  # [B, heads, T, T]
        scores = scores.masked_fill(~mask[:, None], float("-inf"))
        diag = [(q * ki).sum(-1, keepdim=True) * scale for ki, _ in cache[1:]]  # each [B, heads, T, 1]
        probs = torch.softmax(torch.cat([scores] + diag, -1).float(), -1).to(q.dtype)
        out = probs[..., :t] @ v0
        for i, (_, vi) in enumerate(cache[1:]):
            out = out + probs[..., t + i: t + i + 1] * vi
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class Eagle3Draft(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.config = c
        self.fc = nn.Linear(len(c.aux_layer_ids) * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = MidLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))

    def step(self, embeds, hidden, positions, mask, cache):
        """One unroll step. embeds, hidden [B, T, H] -> (normed output for lm_head, pre-norm hidden for the next step)."""
        layer = self.midlayer
        residual = hidden
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], -1)
        residual = layer.self_attn(x, positions, mask, cache) + residual
        prenorm = layer.mlp(layer.post_attention_layernorm(residual)) + residual
        return self.norm(prenorm), prenorm

    def unroll(self, aux, embeds_per_step, positions, mask):
        """Training-time test: yields the normed output of each step. aux [B, T, 3*Ht]; embeds_per_step[j]
        [B, T, H] is the embedding of the token fed at step j (x_{t+1+j} at position t)."""
        hidden = self.fc(aux)
        cache: list = []
        for j, embeds in enumerate(embeds_per_step):
            out, hidden = self.step(embeds, hidden, positions + j, mask, cache)
            yield out

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]


def save_checkpoint(model: Eagle3Draft, out_dir) -> None:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
    state = {k: v if v.dtype in (torch.int64, torch.bool) else v.to(torch.bfloat16) for k, v in state.items()}
    with atomic_path(out_dir / "model.safetensors") as tmp:
        save_file(state, str(tmp), metadata={"format": "pt"})
    with atomic_path(out_dir / "config.json") as tmp:
        tmp.write_text(json.dumps(model.config.to_hf(), indent=2, sort_keys=True) + "\n")


def load_checkpoint(draft_dir, dtype=torch.float32) -> Eagle3Draft:
    draft_dir = Path(draft_dir)
    config = DraftConfig.from_hf(json.loads((draft_dir / "config.json").read_text()))
    model = Eagle3Draft(config)
    state = load_file(str(draft_dir / "model.safetensors"))
    model.load_state_dict({k: v if v.dtype in (torch.int64, torch.bool) else v.to(dtype) for k, v in state.items()})
    return model.to(dtype)
