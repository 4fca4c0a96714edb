"""The extraction benchmark (eaglepipe.tools.bench_extraction) runs on the CPU with a tiny target through the same
code as on the GPU (the stage's streaming path, unpinned ring; the naive path), and reports every figure."""

import json

from eaglepipe.tools import bench_extraction


def test_bench_runs_both_paths_on_cpu_and_reports_limits(tmp_path, tiny_target):
    out = tmp_path / "result.json"
    result = bench_extraction.main(["--target", str(tiny_target), "--device", "cpu", "--dtype", "float32",
                                    "--tokens", "1500", "--shard-tokens", "700", "--chunk-size", "3",
                                    "--max-batch-tokens", "256", "--baseline-batch-tokens", "256",
                                    "--disk-probe-gb", "0.07", "--out", str(tmp_path / "bench"), "--json", str(out),
                                    "--fp8"])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["tokens"] >= 1500 and result["chunk_size"] == 3
    for key in ("fast_tok_s", "naive_tok_s", "compute_limit_tok_s", "disk_limit_tok_s", "share_of_limit",
                "share_of_compute_limit", "share_of_disk_limit", "ratio_to_naive", "writer_tok_s", "sha256_gb_s"):
        assert result[key] > 0, key
    assert result["limit_tok_s"] == min(result["compute_limit_tok_s"], result["disk_limit_tok_s"])
    assert not (tmp_path / "bench" / "writer.safetensors").exists()  # the writer's own shard is not left behind
    assert result["forward_tok_s"] > 0 and result["forward_share_of_compute_limit"] > 0
    assert result["forward_unfused_tok_s"] > 0
    assert "forward_eager_tok_s" not in result  # nothing compiles on the CPU: the forward above is the eager one
    # the CPU has no varlen kernel: both sides of the check are per-sequence SDPA, so they agree exactly
    assert result["packed_check"]["kernel"] == "per-sequence SDPA"
    assert result["packed_check"]["aux_relative_error"] == result["packed_check"]["final_relative_error"] == 0.0
    assert result["packed_check"]["isolation_error"] == 0.0
    assert set(result["packed_check"]["aux_layer_relative_errors"]) == {str(k) for k in result["layer_ids"]}
    # --fp8: both shard dtypes extracted in one run, bytes per token from the shards written (headers included)
    assert result["extract_tok_s_bf16"] == result["fast_tok_s"] and result["extract_tok_s_fp8"] > 0
    per_bf16, per_fp8 = result["bytes_per_token_bf16"], result["bytes_per_token_fp8"]
    assert result["bytes_per_token"] == 4 * 128 * 2 + 5 < per_bf16  # the formula leaves headers aside
    assert per_bf16 / 2 < per_fp8 < per_bf16 / 2 + 4 * 4 + 2.5 + 2  # + the scales, half the id and mask, headers
    assert not list((tmp_path / "bench").glob("fp8*"))


def test_matmul_params_leave_out_the_embedding_and_the_head():
    from transformers import AutoModelForCausalLM, LlamaConfig

    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=100)
    for tied in (False, True):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**small, tie_word_embeddings=tied))
        layers = sum(p.numel() for p in model.model.layers.parameters())
        assert bench_extraction.matmul_params(model) == layers + 32  # + the final norm's weight
