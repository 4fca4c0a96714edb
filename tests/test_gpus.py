"""Each GPU job gets its own devices: concurrent claims never share a GPU, and an impossible claim says why."""

import os
import subprocess
import sys
import time


CLAIM = """
import sys, time
from eaglepipe import gpus
print(",".join(map(str, gpus.claim(int(sys.argv[1]), sys.argv[2]))), flush=True)
time.sleep(float(sys.argv[3]))
"""


def start(count, lock_dir, hold=5.0, gpus=3):
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "SLURM_JOB_ID")}
    env["EAGLEPIPE_NUM_GPUS"] = str(gpus)
    return subprocess.Popen([sys.executable, "-c", CLAIM, str(count), str(lock_dir), str(hold)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_concurrent_jobs_get_disjoint_gpus_and_a_crash_frees_them(tmp_path):
    first, second = start(2, tmp_path), start(1, tmp_path)
    got = [first.stdout.readline().strip(), second.stdout.readline().strip()]
    ids = [int(i) for g in got for i in g.split(",")]
    assert sorted(ids) == [0, 1, 2], got
    # All three are taken: a fourth job waits (more GPU jobs than GPUs, e.g. a profile cap above the node's count)
    # and holds nothing meanwhile, so the 2-GPU claim below is not starved by a partial claim.
    waiting = start(1, tmp_path, hold=30)
    time.sleep(3)
    assert waiting.poll() is None and "waiting for 1 free GPU(s) of 3" in _stderr_so_far(waiting)
    first.kill()  # a crashed job: the kernel drops its locks
    first.wait()
    freed = sorted(set([0, 1, 2]) - set(map(int, got[1].split(","))))
    assert int(waiting.stdout.readline().strip()) in freed
    waiting.kill()
    waiting.wait()
    fourth = start(2, tmp_path, hold=0)
    assert sorted(map(int, fourth.stdout.readline().strip().split(","))) == freed
    second.kill()


def _stderr_so_far(proc) -> str:
    os.set_blocking(proc.stderr.fileno(), False)
    return proc.stderr.read() or ""


def test_more_gpus_than_the_machine_has_is_refused(tmp_path):
    job = start(4, tmp_path, hold=0, gpus=2)
    assert job.wait(30) != 0 and "declares gpu=4 but the machine has 2 GPUs" in job.stderr.read()


def test_no_gpus_declared_claims_nothing(tmp_path):
    job = start(0, tmp_path, hold=0)
    assert job.wait(30) == 0 and job.stdout.read().strip() == ""
    assert not list(tmp_path.iterdir())
