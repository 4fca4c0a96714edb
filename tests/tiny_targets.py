"""Tiny random targets of the architectures the pipeline meets: Qwen3, DeepSeek-V3 (MLA + MoE, the Kimi-K2 family),
and a thinking target with a word-level tokenizer whose chat template writes <think>...</think>."""

from __future__ import annotations

import shutil
from pathlib import Path

TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]
COMMON = dict(vocab_size=49152, hidden_size=128, intermediate_size=256, max_position_embeddings=2048,
              bos_token_id=1, eos_token_id=2, pad_token_id=2)

# A thinking template in the style of Qwen3 / Kimi-K2.5: the generation prompt pre-fills <think> unless thinking is
# off; assistant turns of the history are rendered with their reasoning.
THINKING_TEMPLATE = (
    "{%- for m in messages -%}\n"
    "<|im_start|> {{ m.role }} {% if m.role == 'assistant' %}<think> {{ m.reasoning_content | default('') }} </think> "
    "{% endif %}{{ m.content }} <|im_end|>\n"
    "{% endfor -%}\n"
    "{%- if add_generation_prompt -%}<|im_start|> assistant "
    "{% if enable_thinking is defined and not enable_thinking %}<think> </think> {% else %}<think> {% endif %}"
    "{%- endif -%}\n"
)
WORDS = ["alpha", "beta", "gamma", "delta", "think", "answer", "so", "then", "yes", "no", "maybe", "because",
         "hello", "world", "sum", "two", "three", "five", "what", "is", "the", "of", "and", "a"]


def save(model, out: Path, tokenizer_from: Path) -> Path:
    import torch

    model.to(torch.bfloat16).save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_from / name, out / name)
    return out


def qwen3(out: Path, tokenizer_from: Path, layers: int = 10) -> Path:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                         tie_word_embeddings=True, **COMMON)
    return save(Qwen3ForCausalLM(config), out, tokenizer_from)


def deepseek_v3(out: Path, tokenizer_from: Path, layers: int = 8) -> Path:
    """MLA attention (low-rank q and kv, split rope/nope heads) and MoE layers after the first dense one.
    kv_lora_rank 512 + qk_rope_head_dim 64 are DeepSeek-V3's (and Kimi-K2's): vLLM's CPU MLA kernel needs 576."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    config = DeepseekV3Config(
        num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=64, kv_lora_rank=512,
        qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, moe_intermediate_size=64, n_group=2, topk_group=1, first_k_dense_replace=1,
        tie_word_embeddings=False, **COMMON)
    # Written by DeepSeek-V3's and Kimi-K2's own configs; vLLM builds the router's correction bias from them.
    config.topk_method, config.scoring_func = "noaux_tc", "sigmoid"
    return save(DeepseekV3ForCausalLM(config), out, tokenizer_from)


def thinking_tokenizer():
    """A word-level tokenizer: decode then encode is the identity on any id sequence without the end token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<unk>", "<|im_end|>", "<|im_start|>", "<think>", "</think>",
                                          "system", "user", "assistant", *WORDS])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##")  # joins words with single spaces
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>",
                                        eos_token="<|im_end|>")
    tokenizer.chat_template = THINKING_TEMPLATE
    return tokenizer


def thinking_target(out: Path, layers: int = 8) -> Path:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = thinking_tokenizer()
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=None, eos_token_id=2, pad_token_id=0)
    model = Qwen3ForCausalLM(config)
    # Like a trained model it never emits padding or unknown (which decode drops): only then can text round-trip.
    model.generation_config.suppress_tokens = [tokenizer.pad_token_id, tokenizer.unk_token_id]
    model.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


# moonshotai/Kimi-K2-Instruct's rope keys, as its config.json writes them (legacy rope_scaling with "type").
KIMI_ROPE = {"rope_theta": 50000.0, "max_position_embeddings": 131072, "rope_scaling": {
    "type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 1.0, "beta_slow": 1.0,
    "mscale": 1.0, "mscale_all_dim": 1.0}}


def kimi_rope(out: Path, tokenizer_from: Path, layers: int = 8) -> Path:
    """The tiny DeepSeek-V3 target with Kimi-K2's yarn rope keys written in the published form (transformers 5 would
    save them as rope_parameters)."""
    import json

    deepseek_v3(out, tokenizer_from, layers)
    config = json.loads((out / "config.json").read_text())
    config.pop("rope_parameters", None)
    config.update(json.loads(json.dumps(KIMI_ROPE)))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
