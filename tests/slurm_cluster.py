"""A single-node SLURM cluster on localhost for tests: munged, slurmctld and slurmd from Debian's packages, with
their files in one folder (own munge socket and key, state, logs), started and stopped here.

slurm.conf itself must sit at /etc/slurm/slurm.conf: the executor plugin's job step drops SLURM_* variables
(SLURM_CONF among them) before its `srun`, which then reads the default path. The test writes it there only when no
other configuration is present, and removes it afterwards."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

SYSTEM_CONF = Path("/etc/slurm/slurm.conf")
MARK = "# eaglepipe test cluster: written and removed by tests/slurm_cluster.py\n"
# Character devices that stand in for GPUs; on a GPU machine EAGLEPIPE_TEST_GPU_DEVICES=/dev/nvidia0,... makes them
# real, and SLURM then hands each GPU job its CUDA_VISIBLE_DEVICES.
DEVICES = os.environ.get("EAGLEPIPE_TEST_GPU_DEVICES", "/dev/null,/dev/zero").split(",")
GPUS = len(DEVICES)
BINARIES = ["munged", "mungekey", "slurmctld", "slurmd", "sbatch", "squeue", "sinfo", "scontrol"]


def missing() -> str | None:
    """Why a cluster cannot start here, or None."""
    absent = [b for b in BINARIES if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]
    if absent:
        return f"SLURM/munge binaries absent ({', '.join(absent)}); setup.sh installs slurm-wlm and munge as root"
    if os.geteuid() != 0:
        return "the test cluster's slurmd and munged need root"
    for path in (SYSTEM_CONF, SYSTEM_CONF.with_name("gres.conf"), SYSTEM_CONF.with_name("cgroup.conf")):
        if path.exists() and not path.read_text().startswith(MARK):
            return f"{path} belongs to a real SLURM installation; the test cluster does not replace it"
    if SYSTEM_CONF.exists() and (pid := re.search(r"^SlurmctldPidFile=(\S+)", SYSTEM_CONF.read_text(), re.M)):
        with contextlib.suppress(OSError, ValueError):
            if Path("/proc", Path(pid[1]).read_text().strip()).exists():
                return f"another test cluster is running ({SYSTEM_CONF}, controller pid file {pid[1]})"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node_line() -> str:
    """This host's node definition as slurmd sees it (name, CPUs, memory)."""
    out = subprocess.run([_bin("slurmd"), "-C"], capture_output=True, text=True, check=True).stdout
    return out.splitlines()[0]


def _bin(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def _wait(what: str, check, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"test cluster: {what} not ready within {timeout:.0f} s")
        time.sleep(0.5)


@contextlib.contextmanager
def cluster(folder: Path):
    """Start the cluster; yields the environment under which sbatch/squeue/scontrol talk to it."""
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)
    for sub in ("state", "spool", "munge"):
        (folder / sub).mkdir(exist_ok=True)
    (folder / "munge").chmod(0o700)
    key, sock = folder / "munge" / "munge.key", folder / "munge" / "munge.socket"
    subprocess.run([_bin("mungekey"), "--create", "--keyfile", str(key), "--force"], check=True, capture_output=True)
    key.chmod(0o600)
    node = _node_line()
    host = node.split()[0].split("=")[1]
    conf = SYSTEM_CONF
    conf.parent.mkdir(parents=True, exist_ok=True)
    conf.write_text(MARK + f"""\
ClusterName=eaglepipe-test
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={sock}
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd.log
SlurmctldDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
MpiDefault=none
ReturnToService=2
# No accounting database: job records go to the completion file; squeue sees finished jobs for MinJobAge seconds.
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc={folder}/jobcomp.txt
MinJobAge=300
DefMemPerCPU=1000
# GPUs from gres.conf (stand-ins unless EAGLEPIPE_TEST_GPU_DEVICES names real ones): GPU requests are scheduled
# for real.
GresTypes=gpu
{node.split(" UpTime")[0]} Gres=gpu:{GPUS} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
    devices = "".join(f"NodeName={host} Name=gpu File={dev}\n" for dev in DEVICES)
    (conf.parent / "gres.conf").write_text(MARK + "AutoDetect=off\n" + devices)
    if Path("/sys/fs/cgroup/cgroup.controllers").exists():
        # A unified cgroup v2 host without systemd's D-Bus (a container or VM): slurmd creates its scope itself.
        # Without systemd nothing made system.slice or delegated controllers to it: do both, best effort.
        (conf.parent / "cgroup.conf").write_text(MARK + "CgroupPlugin=cgroup/v2\nIgnoreSystemd=yes\n")
        root = Path("/sys/fs/cgroup")
        (root / "system.slice").mkdir(exist_ok=True)
        for controller in ("cpuset", "cpu", "memory"):
            with contextlib.suppress(OSError):
                (root / "cgroup.subtree_control").write_text(f"+{controller}")
    env = {**os.environ, "SLURM_CONF": str(conf)}
    procs = []
    try:
        procs.append(subprocess.Popen([_bin("munged"), "-F", "--force", f"--key-file={key}", f"--socket={sock}",
                                       f"--pid-file={folder}/munge/munged.pid", f"--log-file={folder}/munged.log",
                                       f"--seed-file={folder}/munge/munged.seed"], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        _wait("munged", sock.exists)
        for daemon in ("slurmctld", "slurmd"):
            args = [_bin(daemon), "-D"] + (["-c", "-i"] if daemon == "slurmctld" else [])
            procs.append(subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

        def idle() -> bool:
            out = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True).stdout
            return out.strip() in ("idle", "mix", "alloc")

        _wait("the node", idle)
        yield env
    finally:
        subprocess.run(["scancel", "--user", "root"], env=env, capture_output=True)
        for proc in reversed(procs):
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        conf.unlink(missing_ok=True)
        (conf.parent / "gres.conf").unlink(missing_ok=True)
        (conf.parent / "cgroup.conf").unlink(missing_ok=True)


JOBCOMP = re.compile(r"JobId=(?P<id>\d+) .*?Name=(?P<name>\S+) .*?JobState=(?P<state>\w+) .*?StartTime=(?P<start>\S+) "
                     r"EndTime=(?P<end>\S+) NodeList=(?P<node>\S+) .*?Tres=(?P<tres>\S+) .*? ExitCode=(?P<exit>\S+)")


def job_records(folder: Path) -> list[dict]:
    """The controller's completion records (jobcomp/filetxt), one dict per finished job."""
    path = folder / "jobcomp.txt"
    text = path.read_text() if path.exists() else ""
    return [m.groupdict() for m in JOBCOMP.finditer(text)]


def main(argv: list[str] | None = None) -> int:
    """Run one command against a fresh test cluster, then print the job records; for runs too long for CI, e.g.
    the embedded default workflow through the SLURM profile:

        sudo .venv/bin/python tests/slurm_cluster.py --folder /tmp/cluster -- \\
            .venv/bin/snakemake --workflow-profile profiles/slurm --slurm-status-command squeue --slurm-no-account
    """
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__.split(";")[0])
    parser.add_argument("--folder", type=Path, required=True, help="the cluster's state, logs and job records")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    if (why := missing()) is not None:
        parser.error(why)
    start = time.monotonic()
    with cluster(args.folder) as env:
        code = subprocess.run(command, env=env).returncode
        elapsed = time.monotonic() - start
        shown = subprocess.run(["scontrol", "show", "job", "-o"], env=env, capture_output=True, text=True).stdout
    (args.folder / "scontrol-jobs.txt").write_text(shown)
    records = job_records(args.folder)
    print(f"\ncommand exited {code} after {elapsed:.0f} s; {len(records)} SLURM job records "
          f"({args.folder}/jobcomp.txt, scontrol view in {args.folder}/scontrol-jobs.txt):")
    for r in records:
        print(f"  job {r['id']:>4} {r['name']:<40} {r['state']:<10} exit {r['exit']:<5} {r['start']} -> {r['end']} "
              f"{r['tres']}")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
