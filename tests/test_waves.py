"""The 8-GPU node plan: jobs of a real dry run packed into waves under the node's GPUs and cores."""

import pytest

from eaglepipe.tools import waves as plan_waves
from conftest import REPO


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("plan")
    return plan_waves.snakemake_jobs(["-d", str(workdir), "--configfile", str(REPO / "config/examples/h200x8.yaml")],
                                     64)


def test_eight_one_gpu_shard_jobs_share_the_node_and_training_takes_it_whole(jobs):
    waves = plan_waves.waves(jobs, gpus=8, cores=64)
    seen = set()
    for wave in waves:
        assert sum(j.gpus for j in wave) <= 8 and sum(j.threads for j in wave) <= 64
        assert all(j.deps <= seen for j in wave), "a job was planned beside or before a job it needs"
        seen |= {j.jobid for j in wave}
    assert seen == set(jobs)
    for rule in ("traces", "hidden_states"):
        shard_waves = [w for w in waves if any(j.rule == rule for j in w)]
        assert len(shard_waves) == 1, f"{rule}: the 8 shard jobs should run as one wave"
        shard_jobs = [j for j in shard_waves[0] if j.rule == rule]
        assert len(shard_jobs) == 8 and all(j.gpus == 1 for j in shard_jobs)
    train = next(w for w in waves if any(j.rule == "train" for j in w))
    assert [j.gpus for j in train if j.rule == "train"] == [8] and sum(j.gpus for j in train) == 8


def test_fewer_gpus_split_the_shards_into_more_waves(jobs):
    import dataclasses

    smaller = {k: dataclasses.replace(j, gpus=min(j.gpus, 4)) for k, j in jobs.items()}
    waves = plan_waves.waves(smaller, gpus=4, cores=64)
    trace_waves = [sum(1 for j in w if j.rule == "traces") for w in waves]
    assert [n for n in trace_waves if n] == [4, 4]
    with pytest.raises(ValueError, match=r"train declares gpu=8, more than the node's 4"):
        plan_waves.waves(jobs, gpus=4, cores=64)
    rendered = plan_waves.render(plan_waves.waves(jobs, 8, 64), 8, 64)
    assert "8/8 GPUs" in rendered and "traces[split=train, i=0]  gpu=1" in rendered
