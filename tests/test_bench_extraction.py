"""The extraction benchmark (eaglepipe.tools.bench_extraction) runs on the CPU with a tiny target through the same
code as on the GPU (the stage's streaming path, unpinned ring; the naive path), and reports every figure."""

import json

from eaglepipe.tools import bench_extraction


def test_bench_runs_both_paths_on_cpu_and_reports_limits(tmp_path, tiny_target):
    out = tmp_path / "result.json"
    result = bench_extraction.main(["--target", str(tiny_target), "--device", "cpu", "--dtype", "float32",
                                    "--tokens", "1500", "--shard-tokens", "700", "--chunk-size", "3",
                                    "--max-batch-tokens", "256", "--baseline-batch-tokens", "256",
                                    "--disk-probe-gb", "0.07", "--out", str(tmp_path / "bench"), "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["tokens"] >= 1500 and result["chunk_size"] == 3
    for key in ("fast_tok_s", "naive_tok_s", "compute_limit_tok_s", "disk_limit_tok_s", "share_of_limit",
                "share_of_compute_limit", "share_of_disk_limit", "ratio_to_naive"):
        assert result[key] > 0, key
    assert result["limit_tok_s"] == min(result["compute_limit_tok_s"], result["disk_limit_tok_s"])
