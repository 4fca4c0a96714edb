"""The transformers engine's fast path: a decode loop and a hidden-state capture that drive the model's own modules.

`model.generate` and `output_hidden_states` are general and slow on a GPU: a cache that grows by concatenation, every
layer's states kept, small batches. For decoder-only targets whose layers follow the Llama layout (Llama, Mistral,
Qwen2, Qwen3), this module runs the same modules (projections, norms, MLP, the model's rotary embedding) with:

- generation: one preallocated KV cache per batch ([rows, kv_heads, prompt + new tokens, head_dim] per layer), left
  padded prompts, large length-sorted batches sized from the device's total memory less the weights (not from what
  is free, so the same device gives the same batches), logits only at the last position, finished rows dropped
  from the batch as they end (the cache is compacted), greedy or temperature / top-p sampling from a seeded
  generator;
- capture: packed batches (sequences one after another, no padding; variable-length flash attention keeps each
  token within its own sequence), only the requested layers' inputs and the final normed state kept, copied to pinned
  host memory without blocking while the next batch runs; the q/k/v and the gate/up projections as one product each
  (their weights stored as row blocks of one tensor, the modules' own weights views into it: no memory added); the
  elementwise work between the products (residual add + norm, q/k norm + rotation, SiLU x up) as one pass each,
  compiled on CUDA (torch.compile; eager elsewhere, the same functions).

Token ids come out exactly as the model computes them; in float32 they equal `model.generate`'s (tests compare them),
in bf16 a different batch composition can round differently and flip a near-tied argmax (README: the measured share).
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..compiled import can_compile, token_axis_dynamic

# model_type values whose decoder layers have the modules this path calls (self_attn.{q,k,v,o}_proj, optional
# q_norm/k_norm, input_layernorm, post_attention_layernorm, mlp) and whose model has embed_tokens, norm, rotary_emb.
SUPPORTED = {"llama", "mistral", "qwen2", "qwen3"}


def supports(model) -> bool:
    """Whether the fast path can run this model: a supported layer layout without sliding-window attention."""
    config = model.config
    inner = getattr(model, "model", None)
    sliding = getattr(config, "use_sliding_window", False) or (
        config.model_type == "mistral" and getattr(config, "sliding_window", None))
    return (config.model_type in SUPPORTED and inner is not None and hasattr(inner, "rotary_emb")
            and hasattr(inner, "layers") and not sliding)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), -1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, d]; cos/sin [B, T, d] as the model's rotary embedding returns them (Llama's rotate-half form)."""
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


def _rms_norm(module, x: torch.Tensor) -> torch.Tensor:
    """The model's RMSNorm (weight * x / sqrt(mean(x^2) + eps): every SUPPORTED layout's form) as torch's rms_norm,
    one fused kernel on CUDA where the module's own forward makes six passes over x in float32 (by the bytes moved,
    about a tenth of an 8B forward at 64K-token batches; not yet measured). The capture uses it; in bf16 it rounds
    once where the module rounds twice (the weight is applied before the cast back), in float32 they agree."""
    return F.rms_norm(x, module.weight.shape, module.weight, module.variance_epsilon)


def _add_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """(h + delta, rms_norm(h + delta) * weight): the residual add and the next norm, one pass over h once compiled."""
    h = h + delta
    return h, F.rms_norm(h, weight.shape, weight, eps)


def _norm_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor | None, eps: float):
    """x [N, heads, d] (a view of a projection's output, any row stride); cos/sin [N, d] -> x rotated, contiguous.
    weight: Qwen3's per-head norm (q_norm/k_norm) applied first, or None."""
    if weight is not None:
        x = F.rms_norm(x, weight.shape, weight, eps)
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up: the MLP's activation, one pass over both once compiled."""
    return F.silu(gate) * up


class Kernels(NamedTuple):
    """The capture's elementwise steps: eager (CPU, and the reference) or compiled by one torch.compile backend."""
    add_norm: object
    norm_rope: object
    swiglu: object


@functools.lru_cache(maxsize=None)
def kernels(backend) -> Kernels:
    """The elementwise steps compiled by backend ("inductor" on CUDA: each a single generated kernel, so no
    intermediate round trip through memory; the token axis symbolic, so a new batch size compiles nothing), or eager
    (None)."""
    # each step and how many leading tensors have the token axis
    steps = ((_add_norm, 2), (_norm_rope, 3), (_swiglu, 2))
    if backend is None:
        return Kernels(*(step for step, _ in steps))
    return Kernels(*(token_axis_dynamic(step, backend, n) for step, n in steps))


class Fused(NamedTuple):
    """Linears that read the same input as one: weight [sum(sizes), in] (and bias), output split into sizes."""
    weight: torch.Tensor
    bias: torch.Tensor | None
    sizes: list[int]

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return F.linear(x, self.weight, self.bias).split(self.sizes, -1)


def fuse(modules) -> Fused | None:
    """These nn.Linear modules' weights (and biases) copied into row blocks of one tensor, each module's own
    parameter then made a view of its block: the same values (the module computes what it did), one product for all,
    no memory added once the old storage is freed. None where they are not plain linears alike (quantized, offloaded,
    mixed dtypes or bias)."""
    first = modules[0]
    alike = all(type(m) is torch.nn.Linear and m.weight.device == first.weight.device
                and m.weight.dtype == first.weight.dtype and m.in_features == first.in_features
                and (m.bias is None) == (first.bias is None) for m in modules)
    if not alike or first.weight.device.type == "meta":
        return None
    with torch.inference_mode(False), torch.no_grad():  # plain tensors: the model stays usable outside capture
        weight = torch.cat([m.weight for m in modules])
        bias = torch.cat([m.bias for m in modules]) if first.bias is not None else None
        at = 0
        for m in modules:
            n = m.out_features
            m.weight.data = weight[at: at + n]
            if bias is not None:
                m.bias.data = bias[at: at + n]
            at += n
    return Fused(weight, bias, [m.out_features for m in modules])


@functools.lru_cache(maxsize=1)
def _varlen_kernel():
    """torch's variable-length flash attention and the keywords this torch's version of it takes, or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    import inspect

    return varlen_attn, set(inspect.signature(varlen_attn).parameters)


@functools.lru_cache(maxsize=None)
def _grouped_kv_probe(kernel, options: tuple, device: torch.device, dtype: torch.dtype) -> bool:
    seeded = torch.Generator(device).manual_seed(0)  # a fixed probe, the global generators untouched
    q = torch.randn(24, 4, 64, device=device, dtype=dtype, generator=seeded)
    k, v = torch.randn(2, 24, 2, 64, device=device, dtype=dtype, generator=seeded)
    cu = torch.tensor([0, 10, 24], dtype=torch.int32, device=device)
    try:
        grouped = kernel(q, k, v, cu, cu, 14, 14, **dict(options))
    except (RuntimeError, ValueError):
        return False
    repeated = kernel(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), cu, cu, 14, 14, **dict(options))
    return bool(torch.equal(grouped, repeated))


def takes_grouped_kv(kernel, options: dict, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the varlen kernel, called with `options`, takes k/v with fewer heads than q (grouped-query attention)
    and gives what it gives for k/v repeated to q's heads, bit for bit: probed once per device and dtype on a tiny
    batch. Flash attention reads each KV head for its group of query heads itself; torch versions whose varlen_attn
    has no enable_gqa keyword still pass k/v to it as they are. Where it does not, the caller repeats k and v (two
    copies per layer)."""
    return _grouped_kv_probe(kernel, tuple(sorted(options.items())), device, dtype)


def _varlen_attention(decoder, cu: torch.Tensor, longest: int, lengths: list[int]):
    """attention(q, k, v) for a packed batch: q [N, heads, d], k/v [N, kv_heads, d] -> [N, heads, d], causal within
    each sequence (cu: the int32 sequence boundaries on q's device)."""
    groups = decoder.heads // decoder.kv_heads
    call = decoder.varlen_call()
    if call is not None:
        varlen_attn, options, repeat = call

        def attention(q, k, v):
            if repeat:
                k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
            return varlen_attn(q, k, v, cu, cu, longest, longest, **options)
        return attention
    ends = list(itertools.accumulate(lengths))
    bounds = [(b - n, b) for b, n in zip(ends, lengths)]

    def attention(q, k, v):
        out = torch.empty_like(q)
        for a, b in bounds:  # [heads, t, d] per sequence
            out[a:b] = F.scaled_dot_product_attention(
                q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1), is_causal=True,
                scale=decoder.scale, enable_gqa=groups > 1).transpose(0, 1)
        return out
    return attention


def _head_norm(attn, name: str) -> tuple[torch.Tensor | None, float]:
    """(weight, eps) of attn's per-head norm `name` (Qwen3's q_norm/k_norm), or (None, 0.0) where there is none."""
    module = getattr(attn, name, None)
    return (None, 0.0) if module is None else (module.weight, module.variance_epsilon)


class Decoder:
    """The layers of one loaded model, run directly."""

    def __init__(self, model):
        self.model = model
        config = model.config
        inner = model.model
        self.embed, self.layers, self.norm, self.rotary = inner.embed_tokens, inner.layers, inner.norm, inner.rotary_emb
        self.lm_head = model.lm_head
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self._table = None
        self.graphs = self.device.type == "cuda"  # CUDA graphs for the decode step (launch overhead dominates it)
        self.varlen = True  # packed capture through the varlen flash kernel where it runs (False: per-sequence SDPA)
        self.fuse = True  # capture with fused q/k/v and gate/up products (False: the modules', as generation runs)
        self._fused = None  # per layer: (q/k/v Fused or None, gate/up Fused or None), made at the first capture
        # the backend that compiles the capture's elementwise steps (kernels()), None: eager
        self.compile = "inductor" if can_compile(self.device) else None
        self.silu = getattr(config, "hidden_act", None) in ("silu", "swish")  # the MLP's act is F.silu: _swiglu runs

    def uses_varlen(self) -> bool:
        """Whether packed capture runs torch's varlen flash kernel: a CUDA device it runs on (compute capability 8.0
        or later), 16-bit weights, a torch that has it."""
        return (self.varlen and self.device.type == "cuda" and self.dtype != torch.float32
                and torch.cuda.get_device_capability(self.device) >= (8, 0) and _varlen_kernel() is not None)

    def varlen_call(self):
        """(kernel, its keyword options, whether k/v are repeated to q's heads first) of the packed capture's
        variable-length flash attention, or None where it does not run (uses_varlen)."""
        kernel = _varlen_kernel() if self.uses_varlen() else None
        if kernel is None:
            return None
        varlen_attn, accepts = kernel
        # torch 2.10 takes is_causal (and no scale: its default, 1/sqrt(d), is the model's); later ones window_size
        options = {"window_size": (-1, 0)} if "window_size" in accepts else {"is_causal": True}
        if "scale" in accepts:
            options["scale"] = self.scale
        grouped = self.heads > self.kv_heads
        if grouped and "enable_gqa" in accepts:
            options["enable_gqa"] = True
        return varlen_attn, options, grouped and not takes_grouped_kv(varlen_attn, options, self.device, self.dtype)

    def rope(self, positions: torch.Tensor, longest: int | None = None):
        """(cos, sin) [B, T, d] at positions [B, T], from a table the model's own rotary embedding computed once;
        longest: a bound on the positions the caller knows (spares a device-to-host sync)."""
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if longest is not None:
            need = longest
        else:  # no host sync inside a graph
            need = 1 if capturing or not positions.numel() else int(positions.max()) + 1
        if self._table is None or self._table[0].shape[0] < need:
            size = max(need, 4096)
            probe = torch.zeros(1, dtype=self.dtype, device=self.device)
            cos, sin = self.rotary(probe, torch.arange(size, device=self.device)[None])
            self._table = (cos[0], sin[0])
        return self._table[0][positions], self._table[1][positions]

    def _qkv(self, attn, h, cos, sin, fused: Fused | None = None):
        b, t, _ = h.shape
        q, k, v = fused(h) if fused is not None else (attn.q_proj(h), attn.k_proj(h), attn.v_proj(h))
        q = q.view(b, t, -1, self.head_dim)
        k = k.view(b, t, -1, self.head_dim)
        v = v.view(b, t, -1, self.head_dim).transpose(1, 2)
        if hasattr(attn, "q_norm"):  # Qwen3: a norm over each head's vector before the rotation
            q, k = attn.q_norm(q), attn.k_norm(k)
        return _rope(q.transpose(1, 2), cos, sin), _rope(k.transpose(1, 2), cos, sin), v

    def _attend(self, q, k, v, mask):
        """q [B, heads, t, d], k/v [B, kv_heads, S, d] under mask (generation's cache). The query heads sharing a KV
        head are stacked along the query axis, so the cache is read as it is, never repeated per query head."""
        b, heads, t, d = q.shape
        if heads > self.kv_heads:  # mask [B, 1, groups * t, S]: grouped_mask() made it
            q = q.reshape(b, self.kv_heads, heads // self.kv_heads * t, d)  # rows g-major, as repeat_kv orders
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale).view(b, heads, t, d)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        return out.transpose(1, 2).reshape(b, t, -1)

    def grouped_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """mask [B, 1, t, S] -> [B, 1, groups * t, S], the rows of _attend's grouped queries (materialised, not a
        broadcast along the query axis)."""
        groups = self.heads // self.kv_heads
        return mask.repeat(1, 1, groups, 1) if groups > 1 else mask

    @staticmethod
    def _layer(layer, h, attend):
        """One decoder layer through its own modules (generation), attention by attend(attn, x)."""
        h = h + layer.self_attn.o_proj(attend(layer.self_attn, layer.input_layernorm(h)))
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def fusions(self) -> list[tuple[Fused | None, Fused | None]]:
        """Per layer, its q/k/v and gate/up projections fused (fuse()), made once."""
        if self._fused is None:
            self._fused = []
            for layer in self.layers:
                attn, mlp = layer.self_attn, layer.mlp
                gate_up = fuse([mlp.gate_proj, mlp.up_proj]) if hasattr(mlp, "gate_proj") else None
                self._fused.append((fuse([attn.q_proj, attn.k_proj, attn.v_proj]), gate_up))
        return self._fused

    # ---- capture ----

    def hidden_states(self, ids: torch.Tensor, lengths: list[int], layer_ids: list[int]):
        """Packed: ids [N] holds sequences of `lengths` tokens one after another (no padding) -> (aux [N, n, H], the
        inputs of layers layer_ids; final [N, H], after the final norm). Each token attends to the earlier tokens of
        its own sequence only: variable-length flash attention on CUDA (torch.nn.attention.varlen), else one causal
        SDPA per sequence (the CPU reference of the same arithmetic)."""
        n_tok = ids.shape[0]
        if sum(lengths) != n_tok:
            raise ValueError(f"packed batch: lengths add up to {sum(lengths)}, but {n_tok} token ids")
        lens = torch.tensor(lengths, dtype=torch.int32)
        cu = F.pad(lens.cumsum(0, dtype=torch.int32), (1, 0))
        # position of each token within its sequence: its index minus its sequence's start
        positions = torch.arange(n_tok, dtype=torch.long) - cu[:-1].long().repeat_interleave(lens.long())
        positions = positions.to(ids.device, non_blocking=True)
        cos, sin = self.rope(positions[None], max(lengths))  # [1, N, d]: the packed batch as one row
        attention = _varlen_attention(self, cu.to(ids.device, non_blocking=True), max(lengths), lengths)
        wanted = {k: i for i, k in enumerate(layer_ids)}
        aux = [None] * len(layer_ids)
        cos, sin = cos[0], sin[0]
        steps = kernels(self.compile)
        fusions = self.fusions() if self.fuse else [(None, None)] * len(self.layers)
        norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        h = self.embed(ids)
        x = _rms_norm(self.layers[0].input_layernorm, h)
        for n, (layer, (qkv, gate_up), norm) in enumerate(zip(self.layers, fusions, norms)):
            if n in wanted:
                aux[wanted[n]] = h
            attn, mlp = layer.self_attn, layer.mlp
            q, k, v = qkv(x) if qkv is not None else (attn.q_proj(x), attn.k_proj(x), attn.v_proj(x))
            q = steps.norm_rope(q.view(n_tok, -1, self.head_dim), cos, sin, *_head_norm(attn, "q_norm"))
            k = steps.norm_rope(k.view(n_tok, -1, self.head_dim), cos, sin, *_head_norm(attn, "k_norm"))
            out = attention(q, k, v.view(n_tok, -1, self.head_dim)).reshape(n_tok, -1)
            post = layer.post_attention_layernorm
            h, x = steps.add_norm(h, attn.o_proj(out), post.weight, post.variance_epsilon)
            if hasattr(mlp, "gate_proj"):
                gate, up = gate_up(x) if gate_up is not None else (mlp.gate_proj(x), mlp.up_proj(x))
                y = mlp.down_proj(steps.swiglu(gate, up) if self.silu else mlp.act_fn(gate) * up)
            else:
                y = mlp(x)
            h, x = steps.add_norm(h, y, norm.weight, norm.variance_epsilon)
        if len(self.layers) in wanted:  # "input of layer N": the last layer's output before the final norm
            aux[wanted[len(self.layers)]] = h
        return torch.stack(aux, -2), x

    # ---- generation ----

    def cache_bytes_per_token(self) -> int:
        return 2 * len(self.layers) * self.kv_heads * self.head_dim * torch.finfo(self.dtype).bits // 8

    def generate(self, prompts: list[list[int]], *, max_new_tokens: int, eos_ids: list[int], pad_id: int,
                 temperature: float, top_p: float, seed: int,
                 prefill_tokens: int = 65536) -> list[tuple[list[int], str]]:
        """One batch: (new token ids, finish reason) per prompt; an end token is kept and ends its row."""
        device, rows = self.device, len(prompts)
        width = max(len(p) for p in prompts)
        ids = torch.full((rows, width), pad_id, dtype=torch.long)
        valid = torch.zeros(rows, width + max_new_tokens, dtype=torch.bool)
        for r, p in enumerate(prompts):  # left padding: every prompt ends at column width - 1
            ids[r, width - len(p):] = torch.tensor(p)
            valid[r, width - len(p): width] = True
        ids, valid = ids.to(device), valid.to(device)
        positions = (valid[:, :width].long().cumsum(1) - 1).clamp(min=0)
        size = width + max_new_tokens
        # Zeros, not empty: columns not yet written are masked, and a masked NaN would still poison a product.
        caches = [(torch.zeros(rows, self.kv_heads, size, self.head_dim, device=device, dtype=self.dtype),
                   torch.zeros(rows, self.kv_heads, size, self.head_dim, device=device, dtype=self.dtype))
                  for _ in self.layers]
        generator = torch.Generator(device).manual_seed(seed) if temperature > 0 else None
        eos = torch.tensor(eos_ids, device=device)

        # Prefill in row groups of at most prefill_tokens padded tokens, each writing its rows of the cache: a query
        # attends to earlier real tokens of its row; padding queries attend to themselves only.
        causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
        eye = torch.eye(width, dtype=torch.bool, device=device)
        group = max(1, prefill_tokens // width)
        logits = []
        for a in range(0, rows, group):
            b = min(a + group, rows)
            mask = (causal[None] & valid[a:b, None, :width]) | eye[None]
            logits.append(self._forward(ids[a:b], positions[a:b], [(k[a:b], v[a:b]) for k, v in caches], 0,
                                        mask[:, None]))
        logits = torch.cat(logits)
        out = torch.empty(rows, max_new_tokens, dtype=torch.long, device=device)
        alive = torch.arange(rows, device=device)  # original row of each batch row
        ended = torch.zeros(rows, dtype=torch.bool, device=device)
        lengths = torch.full((rows,), max_new_tokens, dtype=torch.long, device=device)
        next_pos = positions[:, -1] + 1
        step_fn = None
        for step in range(max_new_tokens):
            token = self._pick(logits, temperature, top_p, generator)
            out[alive, step] = token
            hit = torch.isin(token, eos)
            lengths[alive[hit & ~ended[alive]]] = step + 1
            ended[alive] |= hit
            if step == max_new_tokens - 1:
                break
            if step % 16 == 15:  # one host sync every 16 steps: stop when all rows ended, drop ended rows
                done = ended[alive]
                n_done = int(done.sum())
                if n_done == alive.numel():
                    break
                if n_done * 4 >= alive.numel():
                    keep = (~done).nonzero().squeeze(1)
                    alive, token, next_pos = alive[keep], token[keep], next_pos[keep]
                    valid = valid[keep]
                    # The step (its graph holds the caches) goes first, then each layer's cache is replaced in
                    # place: the old one is freed as its smaller copy is made, so compacting adds one layer's
                    # cache to the peak, not the whole (rows_that_fit's budget counts the cache once).
                    step_fn = None
                    for n, (k, v) in enumerate(caches):
                        caches[n] = (k[keep], v[keep])
                    del k, v
            slot = width + step
            valid[:, slot] = True
            if step_fn is None:  # one decode step over the whole cache width, captured as a CUDA graph on a GPU
                step_fn = _DecodeStep(self, caches, valid)
            logits = step_fn(token, next_pos, slot, valid)
            next_pos = next_pos + 1
        out, lengths, hits = out.cpu(), lengths.cpu(), ended.cpu()
        return [(out[r, : int(lengths[r])].tolist(), "stop" if bool(hits[r]) else "length") for r in range(rows)]

    def _forward(self, ids, positions, caches, slot, mask):
        """Run ids [B, t] at cache columns slot..slot+t-1 (slot an int, or a one-element tensor for a single column);
        attention over the cache's first mask.shape[-1] columns under mask; logits at the last position."""
        h = self.embed(ids)
        cos, sin = self.rope(positions)
        width = mask.shape[-1]
        mask = self.grouped_mask(mask)

        for layer, (k_cache, v_cache) in zip(self.layers, caches):
            def attend(attn, x, k_cache=k_cache, v_cache=v_cache):
                q, k, v = self._qkv(attn, x, cos, sin)
                if isinstance(slot, torch.Tensor):
                    k_cache.index_copy_(2, slot, k)
                    v_cache.index_copy_(2, slot, v)
                else:
                    k_cache[:, :, slot: slot + k.shape[2]] = k
                    v_cache[:, :, slot: slot + k.shape[2]] = v
                return self._attend(q, k_cache[:, :, :width], v_cache[:, :, :width], mask)

            h = self._layer(layer, h, attend)
        return self.lm_head(self.norm(h[:, -1])).float()

    @staticmethod
    def _pick(logits, temperature: float, top_p: float, generator) -> torch.Tensor:
        if temperature <= 0:
            return logits.argmax(-1)
        probs = torch.softmax(logits / temperature, -1)
        if top_p < 1.0:
            sorted_probs, order = probs.sort(-1, descending=True)
            outside = sorted_probs.cumsum(-1) - sorted_probs > top_p  # keep the smallest prefix reaching top_p
            sorted_probs = sorted_probs.masked_fill(outside, 0.0)
            choice = torch.multinomial(sorted_probs, 1, generator=generator).squeeze(1)
            return order.gather(1, choice[:, None]).squeeze(1)
        return torch.multinomial(probs, 1, generator=generator).squeeze(1)


class _DecodeStep:
    """One decode step of a fixed batch over the full cache width, from static input buffers; on CUDA replayed as a
    graph (one launch instead of hundreds), eager elsewhere. Rebuilt when the batch is compacted."""

    def __init__(self, decoder: Decoder, caches, valid: torch.Tensor):
        rows, size = valid.shape
        device = decoder.device
        self.token = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.pos = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.slot = torch.full((1,), size - 1, dtype=torch.long, device=device)
        self.mask = torch.zeros(rows, 1, 1, size, dtype=torch.bool, device=device)
        decoder.rope(torch.tensor([[size]], device=device))  # the rope table must not grow inside the graph
        # Closes over the buffers, not self: without a cycle through it, dropping the step frees its graph and
        # logits at once instead of at the next garbage collection.
        token, pos, slot, mask = self.token, self.pos, self.slot, self.mask
        self.run = lambda: decoder._forward(token, pos, caches, slot, mask)
        self.graph = None
        if decoder.graphs:
            # Warm-up writes column size - 1 (not yet reached, so masked until it is overwritten) under the real
            # mask with that column open, so every value it leaves is finite.
            self.mask.copy_(valid[:, None, None, :])
            self.mask[..., -1] = True
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self.run()
            torch.cuda.current_stream(device).wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.logits = self.run()

    def __call__(self, token, pos, slot: int, valid) -> torch.Tensor:
        self.token.copy_(token[:, None])
        self.pos.copy_(pos[:, None])
        self.slot.fill_(slot)
        self.mask.copy_(valid[:, None, None, :])
        if self.graph is None:
            return self.run()
        self.graph.replay()
        return self.logits


def rows_that_fit(decoder: Decoder, cap: int, share: float = 0.6):
    """A function: tokens per row -> rows of a generation batch whose KV cache and logits fit in `share` of the device
    memory the model leaves (at most cap; CPU: cap). From the device's total memory and the model's own allocation,
    not from what happens to be free, so the same device and settings give the same batches (and samples) every run."""
    if decoder.device.type != "cuda":
        return lambda tokens: cap
    total = torch.cuda.get_device_properties(decoder.device).total_memory
    weights = sum(p.numel() * p.element_size() for p in decoder.model.parameters())
    budget = (total - weights) * share
    vocab = decoder.lm_head.weight.shape[0]
    fixed = 16 * vocab + 64 * decoder.model.config.hidden_size  # logits and sampling buffers, activations of a row
    per_token = decoder.cache_bytes_per_token()
    return lambda tokens: max(1, min(cap, int(budget // (per_token * tokens + fixed))))
