"""The EAGLE-3 draft: one Llama-style decoder layer over fused target hidden states, in plain PyTorch.

Parameter names equal the serving checkpoint's (REFERENCE section 4), so the state dict is the checkpoint:
    fc.weight [H, 3*Ht]; midlayer.self_attn.{q,k,v}_proj.weight [*, 2H]; midlayer.self_attn.o_proj.weight;
    midlayer.mlp.{gate,up,down}_proj.weight; midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight;
    norm.weight; lm_head.weight [Vd, H]; d2t int64 [Vd]; t2d bool [V]; with fc_norm (EAGLE-3.1) also
    fc_norm.{i}.weight [Ht], one per aux layer.
The forward pass follows vLLM's Eagle-3 Llama layer: the embedding and the hidden state are normed separately and
concatenated for attention; the pre-norm output is what the next unroll step receives as its hidden state.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from .compiled import token_axis_dynamic
from .formats import LAYER_CONVENTION, atomic_path
from .rope import KEYS as ROPE_KEYS
from .rope import build as build_rope
from .rope import parameters as rope_parameters
from .rope import rotate_half


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
    # EAGLE-3.1's per-layer norm: each aux hidden state RMS-normed on its own before the fc projection (vLLM's
    # `fc_norm` config key, which vLLM 0.32's llama_eagle3 reads and loads as fc_norm.{i}.weight).
    fc_norm: bool = False

    @property
    def rope_settings(self) -> dict:
        """The keys the rope is built from: the target's, or plain rope at rope_theta for a config without them."""
        return {"max_position_embeddings": self.max_position_embeddings,
                **(self.target_rope or {"rope_theta": self.rope_theta})}

    @classmethod
    def from_target(cls, target: dict, *, draft_vocab_size: int, aux_layer_ids: list[int],
                    fc_norm: bool = False) -> "DraftConfig":
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
            rope_theta=rope_parameters(rope)["rope_theta"], target_rope=rope, fc_norm=fc_norm,
        )

    def to_hf(self) -> dict:
        """config.json in the form vLLM and SGLang load (REFERENCE section 4); `fc_norm` only when set."""
        return {
            "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "num_hidden_layers": 1, "hidden_act": "silu",
            "vocab_size": self.vocab_size, "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size, "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": self.aux_layer_ids, "use_aux_hidden_state": True},
            "eaglepipe": {"layer_convention": LAYER_CONVENTION, "rope_theta": self.rope_theta},
            **self.target_rope,
            **({"fc_norm": True} if self.fc_norm else {}),
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
            rope_theta=hf["eaglepipe"]["rope_theta"], target_rope=rope, fc_norm=bool(hf.get("fc_norm", False)),
        )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class Kernels:
    """The elementwise steps of the draft's layer, on token-major tensors ([tokens, ...]): eager (backend None), or
    each compiled by a torch.compile backend with only the token axis symbolic (train.compile: one generated kernel
    per step and direction instead of one per operation; the same arithmetic, rounded where the compiler fuses)."""

    def __init__(self, backend=None):
        wrap = (lambda step, tensors: token_axis_dynamic(step, backend, tensors)) if backend else (lambda s, _: s)
        self.norm = wrap(rms_norm, 1)
        self.rotate = wrap(rotate_half, 2)
        self.swiglu = wrap(swiglu, 2)


EAGER = Kernels()


class RMSNorm(nn.Module):
    kernels = EAGER

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(*x.shape[:-1], -1)


# How attention is computed (the math is the same; REFERENCE section 4): "merged" attends the context keys of the
# first unroll step with the document-causal structure (flex_attention with a block mask on CUDA, so no T x T score
# matrix is kept; dense scores on other devices) and merges the diagonal entries of later steps through the
# log-sum-exp of the context part; "dense" is the original formulation, one [T, T + steps] score matrix per step,
# kept as the reference and as the naive baseline of eaglepipe.tools.bench_train.
ATTENTION = ("merged", "dense")
FLEX_BLOCK = 128  # flex_attention's block size; packed rows are padded to a multiple of it (or of FLEX_BUCKET)
FLEX_BUCKET = 1024  # longer rows are padded to a multiple of this, so few distinct shapes are compiled


class Packing:
    """The document structure of one packed row, shared by every unroll step and built once per batch:
    doc [T] the index of the sequence each position belongs to. Position t attends s when doc[s] == doc[t], s <= t."""

    def __init__(self, doc: torch.Tensor | None, dense: torch.Tensor | None = None):
        self.doc = doc
        self._dense = dense
        self._block: dict = {}

    @classmethod
    def of(cls, mask_or_packing) -> "Packing":
        """A Packing, or the legacy dense mask [B, T, T] (True = may attend) wrapped as one."""
        if isinstance(mask_or_packing, Packing):
            return mask_or_packing
        return cls(None, dense=mask_or_packing)

    def dense_mask(self) -> torch.Tensor:
        """[1, T, T] bool: causal within each sequence."""
        if self._dense is None:
            idx = torch.arange(self.doc.numel(), device=self.doc.device)
            self._dense = ((self.doc[:, None] == self.doc[None, :]) & (idx[None, :] <= idx[:, None]))[None]
        return self._dense

    def padded_length(self) -> int:
        t = self.doc.numel()
        step = FLEX_BUCKET if t > FLEX_BUCKET else FLEX_BLOCK
        return -(-t // step) * step

    def block_mask(self):
        """flex_attention's BlockMask of the document-causal structure over the padded row (padding is a document of
        its own, so no row is empty); blocks outside every document are skipped by the kernel."""
        t_pad = self.padded_length()
        if t_pad not in self._block:
            from torch.nn.attention.flex_attention import create_block_mask

            doc = torch.cat([self.doc, self.doc.new_full((t_pad - self.doc.numel(),), -1)])

            def document_causal(b, h, q, k):
                return (doc[q] == doc[k]) & (k <= q)

            self._block[t_pad] = create_block_mask(document_causal, None, None, t_pad, t_pad, device=doc.device,
                                                   BLOCK_SIZE=FLEX_BLOCK)
        return self._block[t_pad]


_compiled_flex = None


def flex_context(q, k, v, packing: Packing, scale: float):
    """Context attention by flex_attention: (out [B, heads, T, d], log-sum-exp of the scaled scores [B, heads, T]
    float32). Compiled on CUDA; eager (forward only, materialising the scores) elsewhere, which is how the CPU tests
    check its mask and its log-sum-exp against the dense path."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    fn = flex_attention
    if q.is_cuda:
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=False)
        fn = _compiled_flex
    t, t_pad = q.shape[2], packing.padded_length()
    if t_pad != t:
        q, k, v = (F.pad(x, (0, 0, 0, t_pad - t)) for x in (q, k, v))
    out, aux = fn(q, k, v, block_mask=packing.block_mask(), scale=scale, return_aux=AuxRequest(lse=True))
    return out[:, :, :t], aux.lse[:, :, :t].float()


def dense_context(q, k, v, mask: torch.Tensor, scale: float):
    """Context attention from dense scores (mask [B, T, T]): (out, log-sum-exp [B, heads, T] float32)."""
    scores = ((q @ k.transpose(-1, -2)) * scale).masked_fill(~mask[:, None], float("-inf")).float()
    lse = torch.logsumexp(scores, -1)
    return torch.exp(scores - lse[..., None]).to(q.dtype) @ v, lse


def merge_diagonal(q, out0, lse0, later: list, scale: float) -> torch.Tensor:
    """Softmax over [context scores, diagonal scores of later steps] from the context part's normalised output and
    log-sum-exp: weight of the context = exp(lse0) / Z, of later step i = exp(q.k_i * scale) / Z."""
    if not later:
        return out0
    diag = [(q * ki).sum(-1, keepdim=True) * scale for ki, _ in later]  # each [B, heads, T, 1], as the dense path
    weights = torch.softmax(torch.cat([lse0[..., None]] + [d.float() for d in diag], -1), -1).to(q.dtype)
    out = weights[..., :1] * out0
    for i, (_, vi) in enumerate(later):
        out = out + weights[..., 1 + i: 2 + i] * vi
    return out


class Attention(nn.Module):
    kernels = EAGER

    def __init__(self, c: DraftConfig):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.rope = build_rope(c.rope_settings, c.head_dim)
        self.impl = "merged"

    def forward(self, x, positions, packing, cache: list) -> torch.Tensor:
        """x [B, T, 2H]; packing: a Packing (or a dense mask [B, T, T], True = may attend) for the context entries,
        cache[0]; entries of later unroll steps (cache[1:]) are attended only at their own position (the diagonal)."""
        b, t, _ = x.shape
        c = self.c
        packing = Packing.of(packing)
        # rotated token-major ([B * T, heads, d], the angles shared by q and k), then laid out [B, heads, T, d]
        angles = self.rope.angles(positions.reshape(-1, 1), x.device)  # [B * T, 1, d/2]
        q = self.kernels.rotate(self.q_proj(x).view(b * t, c.num_attention_heads, c.head_dim), angles,
                                self.rope.magnitude).view(b, t, -1, c.head_dim).transpose(1, 2)
        k = self.kernels.rotate(self.k_proj(x).view(b * t, c.num_key_value_heads, c.head_dim), angles,
                                self.rope.magnitude).view(b, t, -1, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        groups = c.num_attention_heads // c.num_key_value_heads
        cache.append((k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)))
        scale = 1.0 / math.sqrt(c.head_dim)
        k0, v0 = cache[0]
        if self.impl == "dense":
            out = self._dense(q, k0, v0, packing.dense_mask(), cache, scale, t)
        else:
            if q.is_cuda and b == 1 and packing.doc is not None:
                out0, lse0 = flex_context(q, k0, v0, packing, scale)
            else:
                out0, lse0 = dense_context(q, k0, v0, packing.dense_mask(), scale)
            out = merge_diagonal(q, out0, lse0, cache[1:], scale)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    @staticmethod
    def _dense(q, k0, v0, mask, cache, scale, t):
        """The original formulation: one score matrix over the context and the diagonal entries."""
        scores = (q @ k0.transpose(-1, -2)) * scale  # [B, heads, T, T]
        scores = scores.masked_fill(~mask[:, None], float("-inf"))
        diag = [(q * ki).sum(-1, keepdim=True) * scale for ki, _ in cache[1:]]  # each [B, heads, T, 1]
        probs = torch.softmax(torch.cat([scores] + diag, -1).float(), -1).to(q.dtype)
        out = probs[..., :t] @ v0
        for i, (_, vi) in enumerate(cache[1:]):
            out = out + probs[..., t + i: t + i + 1] * vi
        return out


class MLP(nn.Module):
    kernels = EAGER

    def __init__(self, c: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.kernels.swiglu(gate.reshape(-1, gate.shape[-1]), up.reshape(-1, up.shape[-1]))
                              .view(gate.shape))


class MidLayer(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class Eagle3Draft(nn.Module):
    kernels = EAGER

    def __init__(self, c: DraftConfig):
        super().__init__()
        self.config = c
        if c.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(c.target_hidden_size, c.rms_norm_eps) for _ in c.aux_layer_ids)
        self.fc = nn.Linear(len(c.aux_layer_ids) * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = MidLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))

    def step(self, embeds, hidden, positions, mask, cache):
        """One unroll step. embeds, hidden [B, T, H] -> (normed output for lm_head, pre-norm hidden for the next
        step)."""
        layer = self.midlayer
        residual = hidden
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], -1)
        residual = layer.self_attn(x, positions, mask, cache) + residual
        prenorm = layer.mlp(layer.post_attention_layernorm(residual)) + residual
        return self.norm(prenorm), prenorm

    def compile_steps(self, backend) -> None:
        """Run the layer's elementwise steps (norms, rotation, SiLU x up) compiled by this torch.compile backend, or
        eager (None); see Kernels."""
        self._use(Kernels(backend) if backend else EAGER)

    @contextlib.contextmanager
    def eager_steps(self):
        """The elementwise steps eager inside the block (an evaluation during training: its no-grad float32 calls
        would add compiled entries towards torch.compile's recompile limit), as they were after it."""
        kernels = self.kernels
        self._use(EAGER)
        try:
            yield
        finally:
            self._use(kernels)

    def _use(self, kernels: Kernels) -> None:
        self.kernels = kernels
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, MLP)):
                module.kernels = kernels

    @property
    def attention(self) -> str:
        return self.midlayer.self_attn.impl

    @attention.setter
    def attention(self, impl: str) -> None:
        if impl not in ATTENTION:
            raise ValueError(f"attention {impl!r}: expected one of {', '.join(ATTENTION)}")
        self.midlayer.self_attn.impl = impl

    def unroll(self, aux, embeds_per_step, positions, packing):
        """Training-time test: yields the normed output of each step. aux [B, T, 3*Ht]; embeds_per_step[j]
        [B, T, H] is the embedding of the token fed at step j (x_{t+1+j} at position t); packing: a Packing or a
        dense mask [B, T, T]."""
        if self.config.fc_norm:  # as vLLM's combine_hidden_states: each aux layer's chunk normed on its own
            chunks = aux.chunk(len(self.fc_norm), -1)
            aux = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks, strict=True)], -1)
        hidden = self.fc(aux)
        cache: list = []
        packing = Packing.of(packing)
        for j, embeds in enumerate(embeds_per_step):
            out, hidden = self.step(embeds, hidden, positions + j, packing, cache)
            yield out

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]


def save_checkpoint(model: Eagle3Draft, out_dir, provenance: dict | None = None) -> None:
    """model.safetensors and config.json; provenance (eaglepipe/provenance.py) goes into config.json's eaglepipe key."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
    state = {k: v if v.dtype in (torch.int64, torch.bool) else v.to(torch.bfloat16) for k, v in state.items()}
    with atomic_path(out_dir / "model.safetensors") as tmp:
        save_file(state, str(tmp), metadata={"format": "pt"})
    config = model.config.to_hf()
    if provenance is not None:
        config["eaglepipe"]["provenance"] = provenance
    with atomic_path(out_dir / "config.json") as tmp:
        tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def load_checkpoint(draft_dir, dtype=torch.float32) -> Eagle3Draft:
    draft_dir = Path(draft_dir)
    config = DraftConfig.from_hf(json.loads((draft_dir / "config.json").read_text()))
    model = Eagle3Draft(config)
    state = load_file(str(draft_dir / "model.safetensors"))
    model.load_state_dict({k: v if v.dtype in (torch.int64, torch.bool) else v.to(dtype) for k, v in state.items()})
    return model.to(dtype)
