"""Bench stage: the target served through vLLM with and without the draft, on the same prompts and settings.

served.json: for each draft length k, mean acceptance length (1 + accepted / drafts, vLLM's spec-decode counters),
per-position acceptance (accepted at position i / drafts) and output tokens/s with and without speculation at batch 1
and at the configured batch; the speedup is their ratio. The prompts served are a seeded random sample of the eval
split (bench.seed; `served_ids` lists them), not the first by id: ids group by source, so the first ones are one kind
of prompt. Offline tau at the same k (from the evaluate stage) sits beside the served figure, over the same
conversations when acceptance.json has their counts (`offline_scope`), with `agrees` telling whether served is within
the configured tolerance of it; `offline_tau_all` is the whole eval split's.
When served falls short beyond the tolerance, `diagnosis` holds served tau of the draft with its layer ids shifted and
the prompts rendered in template variants (diagnose.py), and `cause` names the fault the best variant undoes;
`skipped` says, one line each, which variants were not tried and why (traces' prompt ids under multi_turn `all`).
The draft, its offline acceptance, the eval prompts and traces are the workflow's own, or a draft bundle's
(`bench.draft`; the format is in eaglepipe/bundle.py).
"""

from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

from . import diagnose as diagnose_mod
from . import evaluate, export, provenance
from .bundle import check_fits
from .chat import load_tokenizer, render_chat
from .engines import open_engine
from .engines.base import EngineSettings, Sampling
from .formats import PROMPT_SCHEMA, read_table, write_json
from .reasoning import read_template
from .target import read_info

log = logging.getLogger(__name__)


def timed_generate(eng, prompts, sampling, batch: int) -> tuple[float, int]:
    """Output tokens/s over the prompts, `batch` at a time."""
    start, tokens = time.monotonic(), 0
    for i in range(0, len(prompts), batch):
        tokens += sum(len(g.output_ids) for g in eng.generate(prompts[i: i + batch], sampling))
    return tokens / (time.monotonic() - start), tokens


def run(prompts_path, draft_dir, acceptance_path, output_path, *, target_dir, engine: dict, ks: list[int],
        batch_size: int, batch1_prompts: int, max_prompts: int, max_new_tokens: int, tolerance: float,
        template_kwargs: dict | None = None, traces: list | None = None, diagnose: bool = True,
        diagnose_prompts: int = 4, chat_template: str | None = None, multi_turn: str = "last",
        seed: int | None = 0) -> None:
    template_kwargs = template_kwargs or {}
    # Before any engine loads: a draft of another target, or one whose files disagree, is named, not served.
    check_fits(draft_dir, target_dir)
    prov = provenance.check(draft_dir, target_dir=target_dir)
    context = min(engine.get("max_model_len", 4096), read_info(target_dir).max_position_embeddings)
    problems = export.check(draft_dir, "vllm", layer_ids=prov["layer_ids"], target_dir=target_dir,
                            serving_context=context)
    if problems:
        raise ValueError("the draft would serve badly in vLLM:\n  " + "\n  ".join(problems))
    acceptance = _read_acceptance(acceptance_path)
    # The traces' override template (target.chat_template), when set, is the one served with.
    tokenizer = load_tokenizer(target_dir, read_template(chat_template) if chat_template else None)
    rows = served_rows(read_table(prompts_path, PROMPT_SCHEMA), max_prompts, seed)
    same = evaluate.subset(acceptance, [r["id"] for r in rows])
    offline = same["tau"] if same else acceptance["tau"]
    scope = (f"the {same['sequences']} served conversations" if same else
             "the whole eval split (acceptance.json has no by_sequence counts)")
    log.info("serving %d eval prompts (seed %s); offline tau over %s: %s", len(rows), seed, scope,
             {k: round(v, 3) for k, v in offline.items()})
    conversations = [json.loads(r["messages"]) for r in rows]
    # The bench renders as the traces stage did (same template kwargs), so a template fault shows as a shortfall.
    prompts = [render_chat(tokenizer, m, template_kwargs) for m in conversations]
    sampling = Sampling(max_new_tokens=max_new_tokens)
    base = EngineSettings.from_config({**engine, "name": "vllm", "batch_size": batch_size})
    results = {"prompts": len(prompts), "batch_size": batch_size, "max_new_tokens": max_new_tokens, "k": {},
               "served_ids": [r["id"] for r in rows], "seed": seed, "offline_scope": scope, "diagnosis": None}
    diag_prompts = prompts[:diagnose_prompts]
    traced = _traced_prompt_ids(traces or [], [r["id"] for r in rows[:diagnose_prompts]])
    skipped = [f"{name}: {why}" for name, why in diagnose_mod.skipped_variants(multi_turn).items()]

    def measure(settings, shortfall_check=None):
        with open_engine(target_dir, settings) as eng:
            eng.generate(prompts[:1], Sampling(max_new_tokens=4))  # warm
            before = eng.spec_counters()
            b1, _ = timed_generate(eng, prompts[:batch1_prompts], sampling, 1)
            bn, _ = timed_generate(eng, prompts, sampling, batch_size)
            after = eng.spec_counters()
            delta = {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted_tokens")}
            per_pos = [a - b for a, b in zip(after["accepted_per_pos"], before["accepted_per_pos"] or
                                             [0] * len(after["accepted_per_pos"]))]
            extra = shortfall_check(eng, delta) if shortfall_check else None
        return b1, bn, delta, per_pos, extra

    def templates_if_short(k):
        """While the draft as trained is still served: on a shortfall, tau of the template variants."""
        def check(eng, delta):
            tau, off = 1 + delta["accepted_tokens"] / max(delta["drafts"], 1), offline.get(str(k))
            if not diagnose or results["diagnosis"] is not None or off is None or off - tau <= tolerance * off:
                return None
            log.warning("k=%d: served tau %.3f falls short of offline %.3f by more than %.0f%%: diagnosing on %d "
                        "prompts", k, tau, off, 100 * tolerance, len(diag_prompts))
            as_served, n, se = diagnose_mod.served_tau(eng, diag_prompts, sampling)
            ids = json.loads((Path(draft_dir) / "config.json").read_text())["eagle_config"][
                "eagle_aux_hidden_state_layer_ids"]
            measured = [{"variant": "as served", "kind": "none", "layer_ids": ids, "served_tau": as_served,
                         "drafts": n, "std_error": se}]
            own = load_tokenizer(target_dir) if chat_template else None
            for line in skipped:
                log.info("diagnosis k=%d: %s", k, line)
            for name, variant in diagnose_mod.template_variants(tokenizer, conversations[:diagnose_prompts],
                                                                template_kwargs, traced, own, multi_turn).items():
                vtau, vn, vse = diagnose_mod.served_tau(eng, variant, sampling)
                log.info("diagnosis k=%d: prompts rendered as '%s' -> served tau %.3f (%d drafts)", k, name, vtau, vn)
                measured.append({"variant": name, "kind": "template", "served_tau": vtau, "drafts": vn,
                                 "std_error": vse})
            return measured
        return check

    # The target alone is timed before and after the drafts, and speedups use the mean of the two: a load that
    # comes or goes during the bench (a shared machine) shows as drift instead of as a speedup or a slowdown.
    first = measure(base)[:2]
    bn_key = f"batch_{batch_size}"
    for k in ks:
        settings = replace(base, draft=str(draft_dir), num_speculative_tokens=k)
        b1, bn, delta, per_pos, measured = measure(settings, templates_if_short(k))
        drafts = max(delta["drafts"], 1)
        tau = 1 + delta["accepted_tokens"] / drafts
        off = offline.get(str(k))
        results["k"][str(k)] = {
            "served_tau": tau, "offline_tau": off, "offline_tau_all": acceptance["tau"].get(str(k)),
            "per_position": [p / drafts for p in per_pos],
            "drafts": delta["drafts"], "tok_s": {"batch_1": b1, bn_key: bn},
            "agrees": off is not None and abs(tau - off) <= tolerance * off,
        }
        log.info("k=%d: served tau %.3f vs offline %s; %.2f tok/s at batch 1 (target alone before: %.2f), %.2f at "
                 "batch %d (%.2f)", k, tau, off, b1, first[0], bn, batch_size, first[1])
        if not results["k"][str(k)]["agrees"]:
            log.warning("k=%d: served acceptance %.3f is not within %.0f%% of offline %s", k, tau, 100 * tolerance, off)
        if measured is not None:
            measured += diagnose_mod.layer_shifts(partial(open_engine, target_dir), settings, Path(draft_dir), k=k,
                                                  prompts=diag_prompts, sampling=sampling,
                                                  num_layers=read_info(target_dir).num_layers)
            cause = diagnose_mod.name_cause(measured, offline=off, tolerance=tolerance)
            finding = cause or ("no variant recovers served tau beyond the tolerance and the noise (aux layer ids +-1, "
                                "chat template variants): look at the norm flags, rope settings and "
                                "max_position_embeddings of the draft config, or serve more prompts")
            log.warning("diagnosis k=%d: %s", k, finding)
            results["diagnosis"] = {"k": k, "prompts": len(diag_prompts), "variants": measured, "cause": cause,
                                    "finding": finding, "skipped": skipped}
    last = measure(base)[:2]
    results.update(baseline_speed(first, last, bn_key))
    for k, entry in results["k"].items():
        entry["speedup"] = {key: entry["tok_s"][key] / results["baseline_tok_s"][key] for key in entry["tok_s"]}
        log.info("k=%s: speedup batch 1 %.2fx, %s %.2fx", k, entry["speedup"]["batch_1"], bn_key,
                 entry["speedup"][bn_key])
    write_json(output_path, results)


DRIFT_TOLERANCE = 0.15  # the target alone timed before and after the drafts may differ by this share


def baseline_speed(first: tuple[float, float], last: tuple[float, float], bn_key: str) -> dict:
    """served.json's baseline fields from the target-alone speeds (batch 1, batch n) before and after the drafts:
    baseline_tok_s (their mean, what speedups divide by), baseline_runs, baseline_drift (the larger relative
    difference) and noisy (drift above DRIFT_TOLERANCE: the machine's load changed; rerun on a quiet machine)."""
    keys = ("batch_1", bn_key)
    drift = max(abs(a - b) / max(a, b, 1e-9) for a, b in zip(first, last))
    noisy = drift > DRIFT_TOLERANCE
    if noisy:
        log.warning("the target alone ran %.0f%% apart before and after the drafts (%s then %s tok/s): the machine's "
                    "load changed during the bench, so its speedups are not figures; rerun on a quiet machine",
                    100 * drift, [round(x, 2) for x in first], [round(x, 2) for x in last])
    return {"baseline_tok_s": {k: (a + b) / 2 for k, a, b in zip(keys, first, last)},
            "baseline_runs": [dict(zip(keys, first)), dict(zip(keys, last))],
            "baseline_drift": drift, "noisy": noisy}


def served_rows(rows: list[dict], max_prompts: int, seed: int | None) -> list[dict]:
    """The eval prompts the bench serves: max_prompts of them drawn with `seed` from the rows in id order, or the
    first max_prompts by id when seed is None."""
    rows = sorted(rows, key=lambda r: r["id"])
    if seed is None:
        return rows[:max_prompts]
    return random.Random(seed).sample(rows, min(max_prompts, len(rows)))


def _read_acceptance(path) -> dict:
    """The evaluate stage's acceptance.json (its tau by k as a string is checked)."""
    try:
        acceptance = json.loads(Path(path).read_text())
        acceptance["tau"] = dict(acceptance["tau"])
        return acceptance
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{path}: not an offline acceptance file ({type(err).__name__}: {err}); it must be "
                         "results/eval/acceptance.json of the run that trained the draft") from None


def _traced_prompt_ids(trace_paths: list, ids: list[str]) -> list[list[int]] | None:
    """Prompt ids the traces stage stored for these prompt ids; None when the traces are not given or lack one."""
    stored = {r["id"]: [int(t) for t in r["prompt_ids"]] for path in trace_paths for r in read_table(path)}
    return [stored[i] for i in ids] if ids and all(i in stored for i in ids) else None
