"""The extraction breakdown (eaglepipe.tools.extraction_breakdown) runs on the CPU with a tiny target through the same
code as on the GPU: per batching setting, the forward alone, shards to a folder and shards to a second folder."""

import json

import pytest

from eaglepipe.tools import extraction_breakdown


def test_breakdown_measures_every_setting_and_leaves_no_shards(tmp_path, tiny_target):
    out = tmp_path / "breakdown.json"
    result = extraction_breakdown.main([
        "--target", str(tiny_target), "--device", "cpu", "--dtype", "float32", "--tokens", "1200",
        "--shard-tokens", "500", "--settings", "256:3,512:8", "--disk-probe-gb", "0.05",
        "--out", str(tmp_path / "disk"), "--memory-out", str(tmp_path / "memory"), "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["tokens"] >= 1200 and result["sequences"] > 1
    # 3 aux layers of the 8-layer target + the final state in bf16, the token id and the loss mask
    assert result["bytes_per_token"] == 4 * 128 * 2 + 4 + 1
    assert [(r["max_batch_tokens"], r["chunk_size"]) for r in result["runs"]] == [(256, 3), (512, 8)]
    params = result["runs"][0]["forward_tflops"] * 1e12 / (2 * result["runs"][0]["forward_tok_s"])
    for run in result["runs"]:
        for key in ("forward_tok_s", "shards_tok_s", "memory_shards_tok_s"):
            assert run[key] > 0, key
        assert run["forward_tflops"] * 1e12 / (2 * run["forward_tok_s"]) == pytest.approx(params)
    for key in ("compute_limit_tok_s", "disk_limit_tok_s", "matmul_peak_tflops", "disk_write_gb_s"):
        assert result[key] > 0, key
    assert not (tmp_path / "memory").exists() and not (tmp_path / "disk" / "run").exists()


def test_bad_settings_are_named():
    with pytest.raises(SystemExit, match="max_batch_tokens:chunk_size"):
        extraction_breakdown.settings_of("32768-256")
