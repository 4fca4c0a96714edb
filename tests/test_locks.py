"""A shard being written is locked: a second writer fails at once naming the shard and the process holding it; the
lock goes with its process, however that ends."""

import os
import subprocess
import sys

import pytest

from eaglepipe import hidden_states, locks, traces

HOLD = """
import sys
from eaglepipe import locks
with locks.writing(sys.argv[1], "shard"):
    print("held", flush=True)
    sys.stdin.readline()
"""


@pytest.fixture
def first_writer(tmp_path):
    """Another process writing results/.../shard-0 (holding its lock as the stage functions do)."""
    def start(path):
        proc = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True)
        assert proc.stdout.readline().strip() == "held"
        started.append(proc)
        return proc

    started = []
    yield start
    for proc in started:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("stage", ["traces", "hidden_states"])
def test_a_second_writer_of_a_shard_fails_naming_the_lock_holder(tmp_path, tiny_target, first_writer, stage):
    suffix = ".parquet" if stage == "traces" else ".safetensors"
    out = tmp_path / f"results/{stage}/train/shard-0{suffix}"
    holder = first_writer(out)
    with pytest.raises(locks.LockedError) as err:
        if stage == "traces":
            traces.run(tmp_path / "prompts.parquet", out, target_dir=tiny_target, split="train", shard=0,
                       num_shards=1, engine={"name": "transformers"}, sampling={"max_new_tokens": 2},
                       template_kwargs={}, chunk_size=4, max_error_share=0.0)
        else:
            hidden_states.run(tmp_path / "trace.parquet", out, target_dir=tiny_target, layer_ids=None,
                              engine={"name": "transformers"}, max_length=64, chunk_size=4)
    message = str(err.value)
    assert message.startswith(f"{'trace' if stage == 'traces' else 'hidden-state'} shard {out} is being written by "
                              f"pid {holder.pid} on ")
    assert f"(lock {out.parent}/.{out.name}.lock)" in message and "let the other finish, or stop it" in message
    assert not out.exists()
    holder.kill()  # the kernel drops the lock with the process: the next writer goes ahead
    holder.wait()
    with locks.writing(out, "shard") as lock:
        assert lock.read_text().startswith(f"pid {os.getpid()} on ")
