"""Draft bundles (eaglepipe/bundle.py): made from a workflow directory by the CLI, benched with `bench.draft` by the
real workflow with nothing upstream of the bench, refused with the file named when incomplete or of another target."""

import json
import subprocess
import sys

import pytest

from conftest import planned_rules, snakemake
from eaglepipe import bench, bundle
from eaglepipe.config import defaults
from eaglepipe.draft import DraftConfig
from eaglepipe.formats import PROMPT_SCHEMA, write_table

SERVED = "results/bench/served.json"
BUNDLED = {"config.json": "results/draft/config.json", "model.safetensors": "results/draft/model.safetensors",
           "acceptance.json": "results/eval/acceptance.json", "eval.parquet": "results/prompts/eval.parquet",
           "traces/shard-0.parquet": "results/traces/eval/shard-0.parquet",
           "traces/shard-1.parquet": "results/traces/eval/shard-1.parquet"}


def fake_run(workdir):
    """A workflow directory holding what a bundle copies (distinct bytes each) and files it must leave out."""
    left_out = ["results/draft/train_log.jsonl", "results/traces/train/shard-0.parquet",
                "results/prompts/train.parquet"]
    for i, path in enumerate([*BUNDLED.values(), *left_out]):
        (workdir / path).parent.mkdir(parents=True, exist_ok=True)
        (workdir / path).write_bytes(f"{path} {i}\n".encode())
    return workdir


def make_bundle(*args):
    return subprocess.run([sys.executable, "-m", "eaglepipe.bundle", *map(str, args)],
                          capture_output=True, text=True)


def test_bundle_cli_copies_the_draft_acceptance_eval_prompts_and_traces(tmp_path):
    run = fake_run(tmp_path / "run")
    result = make_bundle("--directory", run, "--out", tmp_path / "bundle")
    assert result.returncode == 0, result.stderr
    files = {str(p.relative_to(tmp_path / "bundle")) for p in (tmp_path / "bundle").rglob("*") if p.is_file()}
    assert files == set(BUNDLED)
    for name, source in BUNDLED.items():
        assert (tmp_path / "bundle" / name).read_bytes() == (run / source).read_bytes(), name
    again = make_bundle("--directory", run, "--out", tmp_path / "bundle")
    assert again.returncode != 0 and "exists; remove it or give another --out" in again.stderr


def test_a_bundle_of_a_variant_takes_its_draft_and_acceptance(tmp_path):
    run = fake_run(tmp_path / "run")
    for name in ("config.json", "model.safetensors", "acceptance.json"):
        (run / "results/drafts/lr-3e-3" / name).parent.mkdir(parents=True, exist_ok=True)
        (run / "results/drafts/lr-3e-3" / name).write_text(f"variant {name}\n")
    result = make_bundle("--directory", run, "--out", tmp_path / "bundle", "--variant", "lr-3e-3")
    assert result.returncode == 0, result.stderr
    for name in ("config.json", "model.safetensors", "acceptance.json"):
        assert (tmp_path / "bundle" / name).read_text() == f"variant {name}\n"
    assert (tmp_path / "bundle/eval.parquet").read_bytes() == (run / BUNDLED["eval.parquet"]).read_bytes()
    missing = make_bundle("--directory", run, "--out", tmp_path / "other", "--variant", "epochs-4")
    assert missing.returncode != 0
    assert "results/drafts/epochs-4/config.json: missing (the draft's config)" in missing.stderr
    assert "results/drafts/epochs-4/acceptance.json first" in missing.stderr


def test_bundle_cli_names_a_missing_file_and_leaves_no_bundle(tmp_path):
    run = fake_run(tmp_path / "run")
    (run / "results/eval/acceptance.json").unlink()
    result = make_bundle("--directory", run, "--out", tmp_path / "bundle")
    assert result.returncode != 0
    assert f"{run}/results/eval/acceptance.json: missing (the draft's offline acceptance)" in result.stderr
    assert "results/eval/acceptance.json first" in result.stderr
    assert not list(tmp_path.glob("*bundle*"))


def test_a_bundle_plans_only_the_target_and_the_bench(tmp_path):
    """The embedded default (target.path null) in a fresh directory: its target rule, then the bench; no pipeline."""
    result = make_bundle("--directory", fake_run(tmp_path / "run"), "--out", tmp_path / "bundle")
    assert result.returncode == 0, result.stderr
    assert {"train", "evaluate", "traces", "prompts"} <= planned_rules(tmp_path / "own", {}, SERVED)
    planned = planned_rules(tmp_path / "served", {"bench": {"draft": str(tmp_path / "bundle")}}, SERVED)
    assert planned == {"target", "target_fingerprint", "bench"}


@pytest.mark.parametrize("remove, message", [
    ("acceptance.json", "acceptance.json is missing (the draft's offline acceptance, results/eval/acceptance.json"),
    ("model.safetensors", "model.safetensors is missing (the draft's weights, results/draft/model.safetensors"),
    ("", "is not a folder; make a draft bundle on the machine that trained the draft"),
], ids=["no-acceptance", "no-weights", "no-folder"])
def test_an_incomplete_bundle_is_named_before_any_job(tmp_path, remove, message):
    assert make_bundle("--directory", fake_run(tmp_path / "run"), "--out", tmp_path / "bundle").returncode == 0
    if remove:
        (tmp_path / "bundle" / remove).unlink()
    folder = tmp_path / ("bundle" if remove else "no-such-bundle")
    result = snakemake(tmp_path / "served", {"bench": {"draft": str(folder)}}, SERVED, "-n", check=False)
    assert result.returncode != 0
    assert message in result.stdout + result.stderr
    assert "python -m eaglepipe.bundle --directory W --out DIR" in result.stdout + result.stderr
    assert not (tmp_path / "served/results").exists()


def draft_bundle(folder, target_config: dict, **changes) -> None:
    """A bundle whose config.json is the draft config the trainer writes for this target, with `changes`."""
    folder.mkdir(parents=True)
    config = DraftConfig.from_target(target_config, draft_vocab_size=512, aux_layer_ids=[2, 4, 5]).to_hf()
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    (folder / "acceptance.json").write_text(json.dumps({"tau": {"2": 1.5}}))
    write_table(folder / "eval.parquet", [{"id": "e0", "source": "t", "messages": json.dumps(
        [{"role": "user", "content": "Hi"}])}], PROMPT_SCHEMA)


@pytest.mark.parametrize("changes, message", [
    ({"target_hidden_size": 576}, "hidden size 576 (target 128)"),
    ({"vocab_size": 32000}, "vocabulary 32000 (target 49152)"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 15, 27], "use_aux_hidden_state": True}},
     "aux layer ids [2, 15, 27] (target has 8 layers)"),
    ({"rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}}, "rope {'rope_theta': 500000.0"),
], ids=["hidden-size", "vocab", "depth", "rope"])
def test_a_draft_of_another_target_is_refused_before_the_engine_loads(tmp_path, tiny_target, changes, message):
    target_config = json.loads((tiny_target / "config.json").read_text())
    draft_bundle(tmp_path / "fits", target_config)
    bundle.check_fits(tmp_path / "fits", tiny_target)  # the trainer's own config for this target fits
    draft_bundle(tmp_path / "other", target_config, **changes)
    with pytest.raises(ValueError) as err:
        bench.run(tmp_path / "other/eval.parquet", tmp_path / "other", tmp_path / "other/acceptance.json",
                  tmp_path / "served.json", tmp_path / "vllm.json", target_dir=tiny_target, engine={},
                  bench={**defaults("bench"), "max_prompts": 1, "max_new_tokens": 2})
    assert str(err.value).startswith(f"{tmp_path}/other/config.json: this draft was trained for another target")
    assert message in str(err.value) and "Set target.path to the target it was trained for" in str(err.value)
    assert not (tmp_path / "served.json").exists()


def test_bench_serves_a_seeded_sample_of_the_eval_prompts():
    """bench.seed: the same seed serves the same prompts; the sample is drawn from every source, not the first ids
    (which group by source); seed null keeps the first by id."""
    from eaglepipe.bench import served_rows

    rows = [{"id": f"{kind}-{i:03d}"} for kind in ("chat", "code", "syn") for i in range(20)]
    first = served_rows(rows, 8, None)
    assert [r["id"] for r in first] == [f"chat-{i:03d}" for i in range(8)]
    sample = served_rows(list(reversed(rows)), 8, 0)
    assert sample == served_rows(rows, 8, 0)  # the order rows come in does not change the sample
    assert len({r["id"] for r in sample}) == 8 and {r["id"].split("-")[0] for r in sample} == {"chat", "code", "syn"}
    assert served_rows(rows, 8, 1) != sample
    assert len(served_rows(rows, 100, 0)) == len(rows)
