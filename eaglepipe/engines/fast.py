"""The transformers engine's fast path: a decode loop and a hidden-state capture that drive the model's own modules.

`model.generate` and `output_hidden_states` are general and slow on a GPU: a cache that grows by concatenation, every
layer's states kept, small batches. For decoder-only targets whose layers follow the Llama layout (Llama, Mistral,
Qwen2, Qwen3), this module runs the same modules (projections, norms, MLP, the model's rotary embedding) with:

- generation: one preallocated KV cache per batch ([rows, kv_heads, prompt + new tokens, head_dim] per layer), left
  padded prompts, large length-sorted batches sized from free device memory, logits only at the last position, finished
  rows dropped from the batch as they end (the cache is compacted), greedy or temperature / top-p sampling from a
  seeded generator;
- capture: right padded, length-sorted batches under a causal mask (padding after a sequence cannot change its
  states), only the requested layers' inputs and the final normed state kept, copied to pinned host memory without
  blocking while the next batch runs.

Token ids come out exactly as the model computes them; in float32 they equal `model.generate`'s (tests compare them),
in bf16 a different batch composition can round differently and flip a near-tied argmax (README: the measured share).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

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

    def _qkv(self, attn, h, cos, sin):
        b, t, _ = h.shape
        q = attn.q_proj(h).view(b, t, -1, self.head_dim)
        k = attn.k_proj(h).view(b, t, -1, self.head_dim)
        v = attn.v_proj(h).view(b, t, -1, self.head_dim).transpose(1, 2)
        if hasattr(attn, "q_norm"):  # Qwen3: a norm over each head's vector before the rotation
            q, k = attn.q_norm(q), attn.k_norm(k)
        return _rope(q.transpose(1, 2), cos, sin), _rope(k.transpose(1, 2), cos, sin), v

    def _attend(self, q, k, v, mask=None, causal=False):
        """q [B, heads, t, d], k/v [B, kv_heads, S, d]. With a mask (generation), the query heads sharing a KV head
        are stacked along the query axis, so the cache is read as it is, never repeated per query head."""
        b, heads, t, d = q.shape
        groups = heads // self.kv_heads
        if mask is not None and groups > 1:
            q = q.reshape(b, self.kv_heads, groups * t, d)  # head kv * groups + g: rows g-major, as repeat_kv orders
            if mask.shape[-2] != 1:
                mask = mask.repeat(1, 1, groups, 1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale).view(b, heads, t, d)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=self.scale,
                                                 enable_gqa=groups > 1)
        return out.transpose(1, 2).reshape(b, t, -1)

    def _layer(self, layer, h, attend):
        x = layer.input_layernorm(h)
        h = h + layer.self_attn.o_proj(attend(layer.self_attn, x))
        return h + layer.mlp(layer.post_attention_layernorm(h))

    # ---- capture ----

    def hidden_states(self, ids: torch.Tensor, layer_ids: list[int]):
        """ids [B, T] right padded -> (aux [B, T, n, H] inputs of layers layer_ids, final [B, T, H] after the norm)."""
        positions = torch.arange(ids.shape[1], device=ids.device)[None].expand(ids.shape[0], -1)
        h = self.embed(ids)
        cos, sin = self.rotary(h, positions)
        wanted = {k: i for i, k in enumerate(layer_ids)}
        aux = [None] * len(layer_ids)

        def attend(attn, x):
            q, k, v = self._qkv(attn, x, cos, sin)
            return self._attend(q, k, v, causal=True)

        for n, layer in enumerate(self.layers):
            if n in wanted:
                aux[wanted[n]] = h
            h = self._layer(layer, h, attend)
        if len(self.layers) in wanted:  # "input of layer N": the last layer's output before the final norm
            aux[wanted[len(self.layers)]] = h
        return torch.stack(aux, 2), self.norm(h)

    # ---- generation ----

    def cache_bytes_per_token(self) -> int:
        return 2 * len(self.layers) * self.kv_heads * self.head_dim * torch.finfo(self.dtype).bits // 8

    def generate(self, prompts: list[list[int]], *, max_new_tokens: int, eos_ids: list[int], pad_id: int,
                 temperature: float, top_p: float, seed: int, prefill_tokens: int = 65536) -> list[tuple[list[int], str]]:
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
        caches = [(torch.empty(rows, self.kv_heads, size, self.head_dim, device=device, dtype=self.dtype),
                   torch.empty(rows, self.kv_heads, size, self.head_dim, device=device, dtype=self.dtype))
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
                                        mask[:, None], last_only=True))
        logits = torch.cat(logits)
        out = torch.empty(rows, max_new_tokens, dtype=torch.long, device=device)
        alive = torch.arange(rows, device=device)  # original row of each batch row
        ended = torch.zeros(rows, dtype=torch.bool, device=device)
        lengths = torch.full((rows,), max_new_tokens, dtype=torch.long, device=device)
        next_pos = positions[:, -1] + 1
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
                    caches = [(k[keep], v[keep]) for k, v in caches]
            slot = width + step
            valid[:, slot] = True
            logits = self._forward(token[:, None], next_pos[:, None], caches, slot,
                                   valid[:, None, None, : slot + 1], last_only=True)
            next_pos = next_pos + 1
        out, lengths, hits = out.cpu(), lengths.cpu(), ended.cpu()
        return [(out[r, : int(lengths[r])].tolist(), "stop" if bool(hits[r]) else "length") for r in range(rows)]

    def _forward(self, ids, positions, caches, slot: int, mask, last_only: bool):
        """Run ids [B, t] at cache columns slot..slot+t-1; attention over columns 0..slot+t-1 under mask."""
        h = self.embed(ids)
        cos, sin = self.rotary(h, positions)
        end = slot + ids.shape[1]

        for layer, (k_cache, v_cache) in zip(self.layers, caches):
            def attend(attn, x, k_cache=k_cache, v_cache=v_cache):
                q, k, v = self._qkv(attn, x, cos, sin)
                k_cache[:, :, slot:end] = k
                v_cache[:, :, slot:end] = v
                return self._attend(q, k_cache[:, :, :end], v_cache[:, :, :end], mask=mask)

            h = self._layer(layer, h, attend)
        if last_only:
            h = h[:, -1]
        return self.lm_head(self.norm(h)).float()

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
