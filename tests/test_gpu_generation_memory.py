"""The fast path's generation stays within the memory rows_that_fit sizes its batches by: the KV cache once, with the
cache compacted in place as rows end (a copy of the whole cache at the first compaction ran a batch sized for an
80 GB card out of memory)."""

import pytest
import torch

from eaglepipe.engines import fast

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def smollm2_shaped():
    """SmolLM2-135M's architecture (30 layers, 9 query and 3 KV heads) with random weights, in bf16 on the GPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         rope_theta=100000.0, tie_word_embeddings=True)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()


@torch.inference_mode()
def test_generation_peak_memory_is_the_cache_once_as_rows_end():
    decoder = fast.Decoder(smollm2_shaped())
    rows, width, new = 512, 256, 384
    cache = rows * (width + new) * decoder.cache_bytes_per_token()
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 49152, (int(n),), generator=generator).tolist()
               for n in torch.randint(width // 2, width + 1, (rows,), generator=generator)]
    prompts[0] = prompts[0][:1] + [7] * (width - 1)  # one prompt of the full width
    # Sampled, with end tokens 4 % of a random model's near-uniform draws: rows end at many different steps, so the
    # cache is compacted again and again.
    eos = list(range(100, 2100))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    # Prefill in small row groups: its activations stay far below the cache, so the bound is about the decode steps.
    outs = decoder.generate(prompts, max_new_tokens=new, eos_ids=eos, pad_id=0, temperature=1.0, top_p=1.0, seed=0,
                            prefill_tokens=16384)
    peak = torch.cuda.max_memory_allocated() - before
    lengths = sorted(len(ids) for ids, _ in outs)
    assert lengths[rows // 4] < lengths[-1], "no row ended early: the test did not compact the cache"
    vocab = decoder.lm_head.weight.shape[0]
    fixed = rows * (16 * vocab + 64 * decoder.model.config.hidden_size)  # rows_that_fit's per-row allowance
    assert peak <= 1.1 * cache + fixed, (
        f"peak {peak / 2**30:.2f} GiB over the cache {cache / 2**30:.2f} GiB + {fixed / 2**30:.2f} GiB per-row "
        f"buffers that rows_that_fit budgets for")
