"""Resume inside a stage: the real workflow is SIGKILLed mid-way through generation and then extraction, rerun, and
continues from its stored units; the final shards are byte-identical to those of an uninterrupted run.

Units of one prompt or sequence make the run long enough in units (22 of them) for the kill to land mid-way.
"""

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import yaml

from conftest import REPO, generate_mixed, snakemake, tiny_config
from eaglepipe.formats import TRACE_SCHEMA, read_table, sha256_file
from eaglepipe.hidden_states import sequences_of
from eaglepipe.resume import Units

TRACES = "results/traces/train/shard-0.parquet"
HIDDEN = "results/hidden_states/train/shard-0.safetensors"


def config_for(target):
    return tiny_config(target, generation={"max_new_tokens": 16, "num_shards": 1, "chunk_size": 1},
                       hidden_states={"max_length": 128, "chunk_size": 1})


def kill_when_units_appear(workdir, config, stage):
    """Start snakemake for the train hidden-state shard, SIGKILL its process group once a unit of `stage` is stored;
    return the names of the units on disk after the kill."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "test-config.yaml").write_text(yaml.safe_dump(config))
    cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", str(workdir), "--cores", "2",
           HIDDEN, "--configfile", str(REPO / "config/config.yaml"), str(workdir / "test-config.yaml")]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    folder = workdir / "results/.progress" / stage / "train/shard-0"
    deadline = time.monotonic() + 300
    try:
        while not list(folder.glob("unit-*.pt")):
            assert proc.poll() is None, f"snakemake ended ({proc.returncode}) before a {stage} unit was stored"
            assert time.monotonic() < deadline, f"no {stage} unit within 300 s"
            time.sleep(0.005)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return sorted(p.name for p in folder.glob("unit-*.pt"))


def reuse(log):
    """(reused, total, computed) from the last reuse line of a job's log."""
    found = re.findall(r"(\d+) of (\d+) units reused from an earlier interrupted run, (\d+) computed",
                       log.read_text())
    assert found, f"no reuse line in {log}"
    return tuple(map(int, found[-1]))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_target):
    config = config_for(tiny_target)
    reference = tmp_path_factory.mktemp("uninterrupted")
    snakemake(reference, config, HIDDEN)
    workdir = tmp_path_factory.mktemp("killed")
    out = {"reference": reference, "workdir": workdir}
    out["trace_units"] = kill_when_units_appear(workdir, config, "traces")
    out["traces_after_kill"] = (workdir / TRACES).exists()
    snakemake(workdir, config, "--unlock")
    out["hidden_units"] = kill_when_units_appear(workdir, config, "hidden_states")
    out["hidden_after_kill"] = (workdir / HIDDEN).exists()
    snakemake(workdir, config, "--unlock")
    snakemake(workdir, config, HIDDEN)
    return out


def test_generation_resumes_from_its_stored_chunks(runs):
    workdir = runs["workdir"]
    n = len(runs["trace_units"])
    total = len(read_table(workdir / "results/prompts/train.parquet"))  # chunks of one prompt
    assert 1 <= n < total and not runs["traces_after_kill"], "the kill did not land mid-way through generation"
    assert reuse(workdir / "logs/traces/train/shard-0.log") == (n, total, total - n)
    assert sha256_file(workdir / TRACES) == sha256_file(runs["reference"] / TRACES)
    assert not (workdir / "results/.progress").exists(), "progress folder left behind"


def test_extraction_resumes_from_its_stored_chunks(runs):
    workdir = runs["workdir"]
    n = len(runs["hidden_units"])
    _, seqs, _ = sequences_of(read_table(workdir / TRACES, TRACE_SCHEMA), 128)
    total = len(seqs)  # chunks of one sequence
    assert 1 <= n < total and not runs["hidden_after_kill"], "the kill did not land mid-way through extraction"
    assert reuse(workdir / "logs/hidden_states/train/shard-0.log") == (n, total, total - n)
    assert sha256_file(workdir / HIDDEN) == sha256_file(runs["reference"] / HIDDEN)
    assert not (workdir / "results/.progress").exists(), "progress folder left behind"


def test_units_of_other_inputs_or_settings_are_discarded(tmp_path):
    first = Units(tmp_path / "p", "key-a", "test")
    first.save(0, {"x": 1})
    first.save(1, {"x": 2})
    assert Units(tmp_path / "p", "key-a", "test").load(1) == {"x": 2}
    changed = Units(tmp_path / "p", "key-b", "test")
    assert changed.load(0) is None and changed.load(1) is None and changed.reused == 0
    assert not list((tmp_path / "p").glob("unit-*"))


def test_a_failed_shard_keeps_its_clean_chunks_and_other_settings_discard_them(tmp_path, small_vocab_target, caplog):
    """Chunks of one prompt: q0 and q1 succeed and are stored, q2-q4 are rejected and not stored (failures may be
    transient), so the shard fails on its error share and a rerun regenerates only the three failed chunks."""
    with pytest.raises(RuntimeError, match="3 of 5 requests failed"):
        generate_mixed(tmp_path, small_vocab_target, max_error_share=0.5, chunk_size=1, max_new_tokens=4)
    assert sorted(p.name for p in (tmp_path / "progress").glob("unit-*.pt")) == ["unit-000000.pt", "unit-000001.pt"]
    for max_new_tokens in (5, 4):  # other settings: the stored chunks are discarded (and regenerated)
        caplog.clear()
        with caplog.at_level("INFO"), pytest.raises(RuntimeError):
            generate_mixed(tmp_path, small_vocab_target, max_error_share=0.5, chunk_size=1,
                           max_new_tokens=max_new_tokens)
        assert "discarding 2 units of earlier work made with other inputs or settings" in caplog.text
    caplog.clear()
    # max_error_share is no input of the rows: raising it reuses the clean chunks
    with caplog.at_level("INFO"):
        out = generate_mixed(tmp_path, small_vocab_target, max_error_share=0.6, chunk_size=1, max_new_tokens=4)
    assert "2 of 5 units reused from an earlier interrupted run, 3 computed" in caplog.text
    fresh = generate_mixed(tmp_path / "fresh", small_vocab_target, max_error_share=0.6, chunk_size=1, max_new_tokens=4)
    assert sha256_file(out) == sha256_file(fresh)
