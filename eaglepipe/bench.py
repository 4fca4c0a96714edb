"""Bench stage: the target served through vLLM with and without the draft, on the same prompts and settings.

served.json: for each draft length k, mean acceptance length (1 + accepted / drafts, vLLM's spec-decode counters),
per-position acceptance (accepted at position i / drafts) and output tokens/s with and without speculation at batch 1
and at the configured batch; the speedup is their ratio. Offline tau at the same k (from the evaluate stage) sits
beside the served figure, with `agrees` telling whether served is within the configured tolerance of offline.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import replace
from pathlib import Path

from .engines.base import EngineSettings, Sampling, open_engine
from .engines.transformers import load_tokenizer, render_chat
from .formats import read_table, write_json

log = logging.getLogger(__name__)


def timed_generate(eng, prompts, sampling, batch: int) -> tuple[float, int]:
    """Output tokens/s over the prompts, `batch` at a time."""
    start, tokens = time.monotonic(), 0
    for i in range(0, len(prompts), batch):
        tokens += sum(len(g.output_ids) for g in eng.generate(prompts[i: i + batch], sampling))
    return tokens / (time.monotonic() - start), tokens


def run(prompts_path, draft_dir, acceptance_path, output_path, *, target_dir, engine: dict, ks: list[int],
        batch_size: int, batch1_prompts: int, max_prompts: int, max_new_tokens: int, tolerance: float) -> None:
    tokenizer = load_tokenizer(target_dir)
    rows = read_table(prompts_path)[:max_prompts]
    prompts = [render_chat(tokenizer, json.loads(r["messages"])) for r in rows]
    sampling = Sampling(max_new_tokens=max_new_tokens)
    offline = json.loads(Path(acceptance_path).read_text())["tau"]
    base = EngineSettings.from_config({**engine, "name": "vllm", "batch_size": batch_size})
    results = {"prompts": len(prompts), "batch_size": batch_size, "max_new_tokens": max_new_tokens, "k": {}}

    def measure(settings):
        with open_engine(target_dir, settings) as eng:
            eng.generate(prompts[:1], Sampling(max_new_tokens=4))  # warm
            before = eng.spec_counters()
            b1, _ = timed_generate(eng, prompts[:batch1_prompts], sampling, 1)
            bn, _ = timed_generate(eng, prompts, sampling, batch_size)
            after = eng.spec_counters()
        delta = {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted_tokens")}
        per_pos = [a - b for a, b in zip(after["accepted_per_pos"], before["accepted_per_pos"] or
                                         [0] * len(after["accepted_per_pos"]))]
        return b1, bn, delta, per_pos

    base_b1, base_bn, _, _ = measure(base)
    results["baseline_tok_s"] = {"batch_1": base_b1, f"batch_{batch_size}": base_bn}
    for k in ks:
        b1, bn, delta, per_pos = measure(replace(base, draft=str(draft_dir), num_speculative_tokens=k))
        drafts = max(delta["drafts"], 1)
        tau = 1 + delta["accepted_tokens"] / drafts
        off = offline.get(str(k))
        results["k"][str(k)] = {
            "served_tau": tau, "offline_tau": off, "per_position": [p / drafts for p in per_pos],
            "drafts": delta["drafts"], "tok_s": {"batch_1": b1, f"batch_{batch_size}": bn},
            "speedup": {"batch_1": b1 / base_b1, f"batch_{batch_size}": bn / base_bn},
            "agrees": off is not None and abs(tau - off) <= tolerance * off,
        }
        log.info("k=%d: served tau %.3f vs offline %s; speedup batch 1 %.2fx, batch %d %.2fx", k, tau, off,
                 b1 / base_b1, batch_size, bn / base_bn)
        if not results["k"][str(k)]["agrees"]:
            log.warning("k=%d: served acceptance %.3f is not within %.0f%% of offline %s: check the draft's aux layer "
                        "ids and the chat template used at serving time", k, tau, 100 * tolerance, off)
    write_json(output_path, results)
