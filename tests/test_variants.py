"""train.variants in the real workflow on a tiny random Llama: one training job per variant, the comparison, the best
variant as the draft, and a change to one variant retraining that variant alone."""

import json

import pytest
import yaml

from conftest import REPO, snakemake, tiny_config
from eaglepipe import report
from eaglepipe.formats import sha256_file

VARIANTS = {"slow": {"lr": 1e-5}, "fast": {"lr": 3e-3, "schedule": "constant", "loss": "lk"}}
TARGETS = ("results/variants/variants.json", "results/draft/model.safetensors")


def variant_config(target, variants=VARIANTS):
    return tiny_config(target, train={"epochs": 1, "ttt_steps": 2, "max_batch_tokens": 256, "log_every": 2,
                                      "threads": 1, "variants": variants})


@pytest.fixture(scope="module")
def variant_run(tmp_path_factory, tiny_target):
    workdir = tmp_path_factory.mktemp("variants")
    config = variant_config(tiny_target)
    snakemake(workdir, config, *TARGETS)
    return workdir, config


def test_each_variant_trains_as_its_own_job_and_the_best_is_the_draft(variant_run):
    workdir, _ = variant_run
    table = json.loads((workdir / "results/variants/variants.json").read_text())
    assert [r["name"] for r in table["variants"]] == sorted(VARIANTS)
    taus = {}
    for name, overrides in VARIANTS.items():
        draft = workdir / "results/drafts" / name
        assert (workdir / "logs/drafts" / name / "train.log").is_file()  # a job of its own
        trained = json.loads((draft / "config.json").read_text())["eaglepipe"]["provenance"]["train"]
        assert {k: trained[k] for k in overrides} == overrides
        taus[name] = json.loads((draft / "acceptance.json").read_text())["tau"]["3"]
        row = next(r for r in table["variants"] if r["name"] == name)
        assert row["tau"]["3"] == taus[name] and row["overrides"] == overrides
        assert row["train_seconds"] > 0 and row["train_tokens"] > 0 and set(row["tau_at"]) == {"0.7"}
        assert set(row["benchmarks"]) == {"mtbench"}
    assert sha256_file(workdir / "results/drafts/slow/model.safetensors") != sha256_file(
        workdir / "results/drafts/fast/model.safetensors")
    winner = max(sorted(VARIANTS), key=lambda n: (taus[n], -sorted(VARIANTS).index(n)))
    assert table["winner"] == winner
    for name in ("config.json", "model.safetensors", "train_log.jsonl"):
        assert sha256_file(workdir / "results/draft" / name) == sha256_file(workdir / "results/drafts" / winner / name)
    section = "\n".join(report.variants_section(table))
    assert f"the draft below is **{winner}**" in section
    assert all(f"| {n} |" in section or f"| **{n}** |" in section for n in VARIANTS)
    assert (workdir / "results/report/variants.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_changing_one_variants_lr_retrains_only_that_variant(variant_run):
    workdir, config = variant_run
    changed = variant_config(config["target"]["path"], {**VARIANTS, "slow": {"lr": 2e-5}})
    plan = snakemake(workdir, changed, *TARGETS, "-n").stdout
    outputs = [line.split(":", 1)[1] for line in plan.splitlines() if line.strip().startswith("output:")]
    assert any("results/drafts/slow/model.safetensors" in o for o in outputs)
    assert any("results/drafts/slow/acceptance.json" in o for o in outputs)
    assert not any("results/drafts/fast/" in o for o in outputs)  # the other variant is neither trained nor scored
    assert "rule variants:" in plan and "rule train:" in plan
    assert "rule hidden_states:" not in plan and "rule train_variant:" in plan


def test_a_variant_key_that_is_not_a_train_key_is_named(tmp_path, tiny_target):
    result = snakemake(tmp_path, variant_config(tiny_target, {"a": {"learning_rate": 0.1}}), "-n", check=False)
    assert result.returncode != 0
    message = "config key train.variants.a.learning_rate: not a train key a variant can set"
    assert message in result.stdout + result.stderr
    assert not (tmp_path / "results").exists()


def test_selection_keeps_the_weights_of_the_step_with_the_best_held_back_tau(variant_run, tmp_path):
    """train.select: tau on the run's own shards, scoring every step: the kept weights are the best-scored step's,
    and scoring them again gives that figure."""
    import torch

    from eaglepipe import config as cfg
    from eaglepipe import train
    from eaglepipe.batches import sequence_lengths
    from eaglepipe.draft import load_checkpoint
    from eaglepipe.target import load_embeddings

    workdir, config = variant_run
    full = cfg.load(REPO / "config/config.yaml")
    for section, values in config.items():
        full.setdefault(section, {}).update(values)
    settings = {k: v for k, v in cfg.validate(full)["train"].items() if k != "variants"}
    settings.update(select="tau", select_every=1, select_fraction=0.3, log_every=1, lr=3e-3, schedule="constant",
                    checkpoint_every=0)
    manifest = json.loads((workdir / "results/hidden_states/manifest.json").read_text())
    shards = sorted(str(p) for p in (workdir / "results/hidden_states/train").glob("shard-*.safetensors"))
    target = config["target"]["path"]
    train.run(shards, workdir / "results/vocab/vocab_map.safetensors", tmp_path / "draft", target_dir=target,
              layer_ids=manifest["layer_ids"], settings=settings, threads=1, weights_out=tmp_path / "weights")
    records = [json.loads(line) for line in (tmp_path / "draft/train_log.jsonl").read_text().splitlines()]
    scored = {r["step"]: r["held_back_tau3"] for r in records}
    assert len(scored) == records[-1]["step"] > 1
    chosen = records[-1]["selected_step"]
    assert chosen == min(s for s, tau in scored.items() if tau == max(scored.values()))
    model = load_checkpoint(tmp_path / "draft")
    model.load_state_dict(torch.load(tmp_path / "weights/rank-0.pt"))
    held = train.held_back([sequence_lengths(p) for p in shards], settings)
    tau = train.held_back_tau(model, shards, held, load_embeddings(target), settings["max_batch_tokens"], "cpu")
    assert tau == pytest.approx(scored[chosen], abs=1e-5)


def sweep_table(taus: dict, overrides: dict, k=3) -> dict:
    return {"k": k, "variants": [{"name": n, "overrides": overrides[n], "tau": {str(k): t}} for n, t in taus.items()]}


def test_the_combination_merges_the_winners_overrides_best_first():
    from eaglepipe.variants import combination

    overrides = {"recipe": {}, "epochs-4": {"epochs": 4}, "lr-3e-4": {"lr": 3e-4}, "lr-3e-3": {"lr": 3e-3},
                 "loss-lk": {"loss": "lk", "lr": 5e-4}, "muon": {"optimizer": "muon"}}
    taus = {"recipe": 2.60, "epochs-4": 2.71, "lr-3e-4": 2.55, "lr-3e-3": 2.66, "loss-lk": 2.64, "muon": 2.60}
    # muon ties the baseline (no gain); lr-3e-3 beats loss-lk, so lr comes from it and loss-lk adds only its loss
    assert combination(sweep_table(taus, overrides)) == {"epochs": 4, "lr": 3e-3, "loss": "lk"}
    assert combination(sweep_table({**taus, "epochs-4": 2.5, "lr-3e-3": 2.5, "loss-lk": 2.5},
                                   overrides)) is None  # no winner: nothing to combine
    assert combination(sweep_table({**taus, "lr-3e-3": 2.5, "loss-lk": 2.5}, overrides)) is None  # one winner
    both_lr = {**taus, "epochs-4": 2.5, "loss-lk": 2.5, "lr-3e-4": 2.62}  # two lr winners: the merge is lr-3e-3
    assert combination(sweep_table(both_lr, overrides)) is None
    with pytest.raises(ValueError, match="exactly one variant without overrides"):
        combination(sweep_table({"a": 2.0, "b": 2.1}, {"a": {"lr": 1e-3}, "b": {"lr": 2e-3}}))


def test_the_combined_variant_is_the_only_new_job_of_the_second_pass(variant_run, tmp_path):
    """combine_variants' config file, given after the sweep's own, adds its variant: the dry run trains and scores it
    and compares again, and leaves the first pass's variants alone."""
    import subprocess
    import sys

    from eaglepipe.tools import combine_variants

    workdir, _ = variant_run
    table = tmp_path / "variants.json"
    table.write_text(json.dumps(sweep_table({"base": 1.5, "slow": 1.6, "fast": 1.7},
                                            {"base": {}, "slow": {"ttt_decay": 1.0}, "fast": {"lr": 3e-3}})))
    combined = tmp_path / "combined.yaml"
    assert combine_variants.main(["--table", str(table), "--out", str(combined)]) == 0
    assert yaml.safe_load(combined.read_text()) == {"train": {"variants": {"combined": {"lr": 3e-3, "ttt_decay": 1.0}}}}

    def planned(*extra):  # outputs of the jobs a dry run plans (the module's other tests may leave some to redo)
        plan = subprocess.run([sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", str(workdir),
                               "-n", "--cores", "1", *TARGETS, "--configfile", str(REPO / "config/config.yaml"),
                               str(workdir / "test-config.yaml"), *extra], capture_output=True, text=True)
        assert plan.returncode == 0, plan.stderr[-3000:]
        return {o.strip() for line in plan.stdout.splitlines() if line.strip().startswith("output:")
                for o in line.split(":", 1)[1].split(",")}

    added = planned(str(combined)) - planned()
    assert {"results/drafts/combined/model.safetensors", "results/drafts/combined/acceptance.json"} <= added
    assert not any(o.startswith(("results/drafts/slow/", "results/drafts/fast/")) for o in added)
    with pytest.raises(SystemExit, match="already has a variant named fast"):
        combine_variants.main(["--table", str(table), "--name", "fast", "--out", str(tmp_path / "again.yaml")])


def test_a_trained_variant_is_scored_before_the_next_one_trains(variant_run, tmp_path):
    """Evaluation outranks training (priority): on one core the jobs go train, score, train, score, so a sweep stopped
    part-way has figures for every variant it trained."""
    import re
    import shutil

    workdir, config = variant_run
    copy = tmp_path / "run"
    shutil.copytree(workdir, copy, symlinks=True)
    done = snakemake(copy, config, *TARGETS, "--forcerun", "train_variant", "--cores", "1")
    log = done.stdout + done.stderr
    order = re.findall(r"rule (train_variant|evaluate_variant|benchmark_evaluate_variant):.*?wildcards: variant=(\w+)",
                       log, re.S)
    assert len(order) == 3 * len(VARIANTS), log[-3000:]
    first = order[0][1]
    assert order[0][0] == "train_variant" and {rule for rule, v in order[:3] if v == first} == {
        "train_variant", "evaluate_variant", "benchmark_evaluate_variant"}, order
