"""Preflight: busy GPUs (from recorded nvidia-smi output: CI has no GPU), disk space, target and config checks.

The functions fed here are the ones the engine jobs run on GPU machines; only nvidia-smi's text is recorded.
"""

import logging
import re
import shutil
import time
from pathlib import Path

import pytest

from conftest import snakemake, tiny_config
from eaglepipe import preflight
from eaglepipe.target import read_info

# `nvidia-smi --query-gpu=index,uuid --format=csv,noheader` and
# `nvidia-smi --query-compute-apps=pid,process_name,used_memory,gpu_uuid --format=csv,noheader` on an 8-GPU node
# where a forgotten vLLM server holds GPUs 2 and 3 and a notebook GPU 6.
GPUS = "\n".join(f"{i}, GPU-{i}aa1c0de-77f3-1b2c-9d4e-00000000000{i}" for i in range(8)) + "\n"
APPS = """\
48213, /usr/bin/python3, 70524 MiB, GPU-2aa1c0de-77f3-1b2c-9d4e-000000000002
48214, VLLM::Worker_TP1, 70524 MiB, GPU-3aa1c0de-77f3-1b2c-9d4e-000000000003
51002, /opt/conda/bin/python -m ipykernel, 1200 MiB, GPU-6aa1c0de-77f3-1b2c-9d4e-000000000006
"""


RECORDED = Path(__file__).parent / "data/nvidia-smi"


@pytest.mark.parametrize("apps", ["compute-apps.csv", "compute-apps-nounits.csv"])
def test_recorded_h200_output_with_a_process_holding_memory(apps):
    gpus = (RECORDED / "gpus.csv").read_text()
    with pytest.raises(preflight.PreflightError, match=r"GPU 0: pid 430 \(python3\) holds 2566 MiB"):
        preflight.check_gpus(1, allow_busy=False, apps_text=(RECORDED / apps).read_text(), gpus_text=gpus,
                             visible="0", own_pid=1)
    preflight.check_gpus(1, allow_busy=False, apps_text=(RECORDED / "compute-apps-idle.csv").read_text(),
                         gpus_text=gpus, visible="0", own_pid=1)


def test_busy_gpus_are_named_with_pid_process_memory_and_what_to_do():
    with pytest.raises(preflight.PreflightError) as err:
        preflight.check_gpus(4, allow_busy=False, apps_text=APPS, gpus_text=GPUS, visible="0,1,2,3", own_pid=1)
    message = str(err.value)
    assert "GPU 2: pid 48213 (/usr/bin/python3) holds 70524 MiB" in message
    assert "GPU 3: pid 48214 (VLLM::Worker_TP1) holds 70524 MiB" in message
    assert "51002" not in message, "a process on a GPU the job was not given was blamed"
    assert "kill <pid>" in message and "preflight.allow_busy_gpus: true" in message


def test_free_gpus_pass_and_uuids_in_cuda_visible_devices_are_understood():
    preflight.check_gpus(2, allow_busy=False, apps_text=APPS, gpus_text=GPUS, visible="4,5", own_pid=1)
    with pytest.raises(preflight.PreflightError, match="GPU 6: pid 51002"):
        preflight.check_gpus(1, allow_busy=False, apps_text=APPS, gpus_text=GPUS, own_pid=1,
                             visible="GPU-6aa1c0de-77f3-1b2c-9d4e-000000000006")


def test_busy_gpus_only_warn_when_allowed_and_the_job_itself_is_not_blamed(caplog):
    with caplog.at_level(logging.WARNING):
        preflight.check_gpus(1, allow_busy=True, apps_text=APPS, gpus_text=GPUS, visible="2", own_pid=1)
    assert "pid 48213" in caplog.text
    preflight.check_gpus(1, allow_busy=False, apps_text=APPS, gpus_text=GPUS, visible="2", own_pid=48213)


def test_nounits_output_and_unknown_memory_parse():
    procs = preflight.parse_compute_apps("7, a, b, 512, GPU-x\n8, vllm, [N/A], GPU-y\n")
    assert [(p.pid, p.name, p.used_mib) for p in procs] == [(7, "a, b", 512), (8, "vllm", None)]


def test_without_nvidia_smi_the_check_is_skipped_with_a_log_line(caplog):
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has nvidia-smi: the live query runs instead")
    with caplog.at_level(logging.INFO):
        preflight.check_gpus(1, allow_busy=False)
    assert "nvidia-smi not found, GPU occupancy not checked" in caplog.text


def test_disk_too_small_names_needed_and_free_bytes_and_the_folder(tmp_path):
    needed = 828 * preflight.GIB
    with pytest.raises(preflight.PreflightError) as err:
        preflight.check_disk(tmp_path / "results/hidden_states", needed, free_bytes=500 * preflight.GIB,
                             what="hidden-state shards")
    message = str(err.value)
    assert f"hidden-state shards in {tmp_path}/results/hidden_states" in message
    assert f"828.00 GiB needed ({needed} bytes), 500.00 GiB free" in message
    preflight.check_disk(tmp_path, needed, free_bytes=900 * preflight.GIB)


def test_stage_estimate_counts_unwritten_shards_and_resume_units(tmp_path):
    done = tmp_path / "shard-0.safetensors"
    done.write_bytes(b"x")
    outputs = [str(done)] + [str(tmp_path / f"shard-{i}.safetensors") for i in (1, 2, 3)]
    assert preflight.stage_bytes(100, outputs) == 100 * (3 + 1)
    # hidden states resume from their partial shard: no second copy to make room for
    assert preflight.stage_bytes(100, outputs, resume_copy=False) == 100 * 3
    # tokens x (3 aux + final) x hidden x 2 bytes, plus the int32 id and uint8 mask per token
    assert preflight.hidden_state_bytes(1000, 3, 7168) == 1000 * (4 * 7168 * 2 + 5)
    # fp8: one byte per value and a float32 scale per row of each of the 4 layers
    assert preflight.hidden_state_bytes(1000, 3, 7168, "float8_e4m3fn") == 1000 * (4 * 7168 + 4 * 4 + 5)


def test_disk_check_fails_the_job_before_the_engine_loads(tmp_path, tiny_target):
    """The real job's check against the real disk, made to fail by a reserve larger than any disk."""
    config = tiny_config(tiny_target, preflight={"reserve_disk_gib": 1e9}, generation={"num_shards": 1})
    start = time.monotonic()
    result = snakemake(tmp_path, config, "results/traces/train/shard-0.parquet", check=False)
    elapsed = time.monotonic() - start
    assert result.returncode != 0
    log = (tmp_path / "logs/traces/train/shard-0.log").read_text()
    assert "not enough disk for trace shards in results/traces/train" in log
    assert "preflight.reserve_disk_gib keeps" in log and "Loading weights" not in log
    assert not list((tmp_path / "results/traces").rglob("*.parquet"))
    print(f"the failing workflow (prompts job, then the failed traces job) took {elapsed:.0f} s")


def test_disk_estimate_counts_the_shards_of_the_jobs_own_split(tmp_path, tiny_target):
    """A train job's estimate covers the train shards not yet written (and its resume copy), not the eval shards:
    those are a few percent of its size, and counting them at its size stopped a run whose data fitted the disk."""
    config = tiny_config(tiny_target, preflight={"reserve_disk_gib": 1e9}, generation={"num_shards": 2})
    result = snakemake(tmp_path, config, "results/traces/train/shard-0.parquet", check=False)
    assert result.returncode != 0
    log = (tmp_path / "logs/traces/train/shard-0.log").read_text()
    needed = int(re.search(r"GiB needed \((\d+) bytes\)", log).group(1))
    job = preflight.traces_estimate(tmp_path / "results/prompts/train.parquet", 0, 2,
                                    config["generation"]["max_new_tokens"])
    assert job > 0 and needed == job * (2 + 1), f"{needed} bytes is not 2 train shards + the resume copy of {job}"


def test_layer_ids_beyond_the_targets_depth(tiny_target):
    config = tiny_config(tiny_target, hidden_states={"aux_layer_ids": [2, 4, 9]})
    with pytest.raises(preflight.PreflightError, match=r"hidden_states.aux_layer_ids: \[2, 4, 9\] must be 3 increasing "
                                                       r"ids in \[0, 7\] for a target with 8 layers"):
        preflight.check_config(_filled(config), read_info(tiny_target))


def test_draft_vocab_larger_than_the_targets(tiny_target):
    config = tiny_config(tiny_target, vocab={"draft_vocab_size": 60000})
    with pytest.raises(preflight.PreflightError, match=r"vocab.draft_vocab_size: 60000 is larger than the target's "
                                                       r"vocabulary \(49152\)"):
        preflight.check_config(_filled(config), read_info(tiny_target))


def _filled(config):
    from eaglepipe.config import validate

    return validate(config)
