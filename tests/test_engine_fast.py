"""The transformers engine's fast path (eaglepipe/engines/fast.py) against the model's own forward and generate.

The fast path is what runs on a GPU; CI has none, so its logic is checked here on the CPU in float32, where it must
give the same hidden states (to float32 rounding) and the same greedy token ids as transformers' own code.
"""

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from eaglepipe.engines.fast import Decoder, supports

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=300, max_position_embeddings=512, tie_word_embeddings=False)


def model_of(kind: str):
    torch.manual_seed(0)
    config = LlamaConfig(**SMALL, rope_theta=10000.0) if kind == "llama" else Qwen3Config(**SMALL, head_dim=16)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # larger weights than the init: distinct, confident next tokens, so argmax ties are rare
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    return model


PROMPTS = [[5, 9, 200, 31, 7, 8], [77, 3], [8, 8, 8, 8, 1, 2, 3, 4, 5, 6, 7], [250]]


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_capture_equals_output_hidden_states(kind):
    """Packed sequences (no padding) give each sequence the states it has alone: attention never crosses into the
    sequence before it, positions restart at 0 for each."""
    model = model_of(kind)
    assert supports(model)
    ids = torch.tensor([t for p in PROMPTS for t in p])
    with torch.no_grad():
        aux, final = Decoder(model).hidden_states(ids, [len(p) for p in PROMPTS], [0, 2, 4])
        at = 0
        for p in PROMPTS:
            ref = model(torch.tensor([p]), output_hidden_states=True)
            n = len(p)
            for i, k in enumerate([0, 2]):
                torch.testing.assert_close(aux[at: at + n, i], ref.hidden_states[k][0], rtol=1e-5, atol=1e-5)
            # id 4 = number of layers: the last layer's output before the final norm
            torch.testing.assert_close(final[at: at + n], ref.hidden_states[-1][0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(model.model.norm(aux[at: at + n, 2]), final[at: at + n], rtol=1e-5, atol=1e-5)
            at += n


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_fused_norm_equals_the_model_norm(kind):
    """The capture's rms_norm against each layout's own RMSNorm module: equal in float32, within one bf16 rounding of
    the output in bf16 (it applies the weight before the cast back where the module rounds first)."""
    from eaglepipe.engines.fast import _rms_norm

    model = model_of(kind)
    norm = model.model.layers[1].post_attention_layernorm
    with torch.no_grad():
        norm.weight.uniform_(0.5, 2.0)
        x = torch.randn(33, SMALL["hidden_size"]) * 3
        torch.testing.assert_close(_rms_norm(norm, x), norm(x), rtol=1e-6, atol=1e-6)
        norm.to(torch.bfloat16)
        got, ref = _rms_norm(norm, x.bfloat16()).float(), norm(x.bfloat16()).float()
        assert ((got - ref).abs() <= 2 * 2 ** -8 * ref.abs() + 1e-6).all()


@pytest.mark.parametrize("kind", ["llama-biases", "qwen3"])
def test_fused_projections_change_no_value_and_add_no_memory(kind):
    """The capture's fused q/k/v and gate/up products: the modules' weights become views of the fused tensors (the
    model's own forward gives the very same output, the parameters take the bytes they took), and the capture equals
    the unfused one."""
    if kind == "qwen3":
        model = model_of(kind)
    else:  # Llama with projection biases: the fused bias path
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(LlamaConfig(**SMALL, attention_bias=True, mlp_bias=True),
                                                 dtype=torch.float32).eval()
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, torch.nn.Linear) and m.bias is not None:
                    m.bias.uniform_(-0.5, 0.5)

    def storage_bytes():
        return sum({p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}.values())

    ids = torch.tensor([t for p in PROMPTS for t in p])
    lengths = [len(p) for p in PROMPTS]
    decoder = Decoder(model)
    with torch.no_grad():
        before_bytes, before = storage_bytes(), model(ids[None]).logits
        decoder.fuse = False
        plain = decoder.hidden_states(ids, lengths, [1, 3])
        decoder.fuse = True
        fused = decoder.hidden_states(ids, lengths, [1, 3])
        after = model(ids[None]).logits
    qkv, gate_up = decoder.fusions()[1]
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    assert qkv is not None and gate_up is not None
    assert attn.k_proj.weight.data_ptr() == qkv.weight.data_ptr() + attn.q_proj.weight.numel() * 4
    assert mlp.up_proj.weight.untyped_storage().data_ptr() == gate_up.weight.untyped_storage().data_ptr()
    assert (qkv.bias is not None) == (kind == "llama-biases")
    assert storage_bytes() == before_bytes
    assert torch.equal(after, before)
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_compiled_capture_steps_trace_whole_once_and_equal_eager(kind):
    """The capture's elementwise steps as CUDA runs them, through torch.compile (here a backend that records each
    graph and runs it as traced, since CI has no GPU): each traces whole (fullgraph), a batch of another size compiles
    nothing new (the token axis symbolic: no recompiles as batches vary, every other size static), and the states
    equal the eager path's."""
    torch._dynamo.reset()
    graphs = []

    def backend(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    model = model_of(kind)
    eager, compiled = Decoder(model), Decoder(model)
    eager.compile, compiled.compile = None, backend
    with torch.no_grad():
        for prompts in (PROMPTS, PROMPTS[:2] + [[4, 5, 6]]):
            ids = torch.tensor([t for p in prompts for t in p])
            lengths = [len(p) for p in prompts]
            got, ref = compiled.hidden_states(ids, lengths, [1, 3]), eager.hidden_states(ids, lengths, [1, 3])
            for a, b in zip(got, ref):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
            if prompts is PROMPTS:
                first = len(graphs)
    ops = " ".join(str(node.target) for graph in graphs for node in graph.graph.nodes)
    assert first >= 3 and len(graphs) == first, f"{first} graphs for the first batch, {len(graphs)} after the second"
    assert "rms_norm" in ops and "silu" in ops
    # Only the token axis is symbolic: heads, head_dim, hidden and strides are constants of the generated code.
    for graph in graphs:
        inputs = [node.meta["example_value"] for node in graph.graph.nodes if node.op == "placeholder"]
        tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
        token_axis = [t for t in tensors if isinstance(t.shape[0], torch.SymInt)]
        assert token_axis, f"no input with a symbolic token axis in {graph.code}"
        for t in tensors:
            assert all(isinstance(n, int) for n in t.shape[1:]), f"an input of shape {t.shape} in {graph.code}"
            assert all(isinstance(n, int) for n in t.stride()[1:]), f"an input of strides {t.stride()}"


def test_packed_capture_refuses_lengths_that_do_not_add_up():
    with pytest.raises(ValueError, match="lengths add up to 5, but 6 token ids"):
        Decoder(model_of("llama")).hidden_states(torch.arange(6), [2, 3], [0])


def reference_greedy(model, prompt, max_new_tokens, eos):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=0,
                             temperature=None, top_p=None, top_k=None)[0, len(prompt):].tolist()
    for pos, tok in enumerate(out):
        if tok in eos:
            return out[: pos + 1], "stop"
    return out, "length"


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_greedy_ids_equal_generate_with_early_ends_and_compaction(kind):
    model = model_of(kind)
    free = [reference_greedy(model, p, 40, [299])[0] for p in PROMPTS]
    # An end token that two rows emit early (at different steps) and the others never do: rows end at different
    # steps, the batch is compacted after step 16, the rest run to max_new_tokens.
    eos = [free[0][5]] if free[0][5] not in free[2] + free[3] else [free[0][20]]
    expected = [reference_greedy(model, p, 40, eos) for p in PROMPTS]
    assert any(f == "stop" for _, f in expected) and any(f == "length" for _, f in expected)
    with torch.no_grad():
        got = Decoder(model).generate(PROMPTS, max_new_tokens=40, eos_ids=eos, pad_id=0, temperature=0.0, top_p=1.0,
                                      seed=0, prefill_tokens=20)  # 20 padded tokens: prefill in row groups
    assert got == expected


def test_sampling_is_seeded_and_top_p_keeps_the_nucleus():
    model = model_of("llama")
    dec = Decoder(model)
    kwargs = dict(max_new_tokens=12, eos_ids=[299], pad_id=0)
    with torch.no_grad():
        a = dec.generate(PROMPTS, temperature=1.0, top_p=0.95, seed=3, **kwargs)
        b = dec.generate(PROMPTS, temperature=1.0, top_p=0.95, seed=3, **kwargs)
        c = dec.generate(PROMPTS, temperature=1.0, top_p=0.95, seed=4, **kwargs)
        narrow = dec.generate(PROMPTS, temperature=1.0, top_p=1e-6, seed=3, **kwargs)  # only the top token
        greedy = dec.generate(PROMPTS, temperature=0.0, top_p=1.0, seed=0, **kwargs)
    assert a == b
    assert a != c
    assert narrow == greedy
    assert a != greedy


def test_engine_fast_path_equals_reference_path(tiny_target):
    """Through the engine interface: batches planned for the fast path, captures split from pinned-style buffers."""
    from eaglepipe.engines import open_engine
    from eaglepipe.engines.base import EngineSettings, Sampling

    seqs = [[1, 5, 9, 200, 31], [1, 77], [1, 8, 8, 8, 8, 8, 8, 8, 8], [1, 2, 3]]
    out = {}
    for fast in (True, False):
        with open_engine(tiny_target, EngineSettings(batch_size=3, max_batch_tokens=20, fast_path=fast)) as eng:
            assert (eng.fast is not None) == fast
            out[fast] = (eng.generate(seqs, Sampling(max_new_tokens=20)), eng.capture(seqs, [1, 2, 3]))
    for a, b in zip(out[True][0], out[False][0]):
        assert (a.output_ids, a.finish_reason) == (b.output_ids, b.finish_reason)
    for a, b in zip(out[True][1], out[False][1]):
        torch.testing.assert_close(a.aux.float(), b.aux.float(), rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(a.final.float(), b.final.float(), rtol=1e-2, atol=1e-2)


def test_fast_path_true_refuses_a_layout_it_does_not_run(tmp_path, smollm2):
    import tiny_targets

    from eaglepipe.engines import open_engine
    from eaglepipe.engines.base import EngineSettings

    target = tiny_targets.deepseek_v3(tmp_path / "dsv3", smollm2, layers=2)
    with pytest.raises(ValueError, match="engine.fast_path: true.*deepseek_v3"):
        open_engine(target, EngineSettings(fast_path=True))


def test_grouped_kv_probe_keeps_repeating_unless_the_kernel_gives_the_same_bits():
    """The varlen kernel gets k/v with fewer heads only where it takes them and gives the repeated call's result
    exactly (probed on CUDA; here CPU kernels of the same signature: per-sequence SDPA done right, one that refuses
    grouped k/v, one that reads grouped heads wrongly)."""
    from eaglepipe.engines.fast import takes_grouped_kv

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, is_causal, wrong=False):
        out = torch.empty_like(q)
        for a, b in zip(cu_q.tolist(), cu_q.tolist()[1:]):
            kk, vv = k[a:b], v[a:b]
            if wrong and kk.shape[1] < q.shape[1]:  # the kv heads tiled, not repeated per group
                kk, vv = kk.repeat(1, q.shape[1] // kk.shape[1], 1), vv.repeat(1, q.shape[1] // vv.shape[1], 1)
            out[a:b] = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), kk.transpose(0, 1),
                                                      vv.transpose(0, 1), is_causal=is_causal,
                                                      enable_gqa=True).transpose(0, 1)
        return out

    def refuses(q, k, v, *args, **options):
        if k.shape[1] != q.shape[1]:
            raise RuntimeError("number of heads in key/value must equal those of query")
        return varlen(q, k, v, *args, **options)

    def tiles(q, k, v, *args, **options):
        return varlen(q, k, v, *args, **options, wrong=True)

    cpu = torch.device("cpu")
    assert takes_grouped_kv(varlen, {"is_causal": True}, cpu, torch.float32)
    assert not takes_grouped_kv(refuses, {"is_causal": True}, cpu, torch.float32)
    assert not takes_grouped_kv(tiles, {"is_causal": True}, cpu, torch.float32)
