"""Bench stage: the target served through vLLM with and without the draft, a k x batch table of speedups, the serving
config chosen from it, and served acceptance against offline acceptance over the same text.

served.json:
    prompts, served_ids, seed, max_new_tokens, batch_sizes, temperatures ([0, bench.temperature]), max_k
    k: {k: {served_tau (pooled over verify steps, vLLM's counters, greedy, every served prompt at the largest batch),
            served_tau_request_mean (each request's own tau from vLLM's per-request metrics, averaged), per_request
            ({id: tau}), per_position (accepted at position i / drafts), drafts, offline_tau (the draft scored offline
            on the target's own greedy continuation of the same prompts, max_new_tokens long: the text served, over
            the verify steps greedy serving takes there, evaluate.walk), offline_tau_positions (the same text pooled
            over every start position, the evaluate stage's definition), offline_tau_request_mean, offline_tau_traces
            (the evaluate stage's, over the traces' whole responses of the same conversations when acceptance.json
            has their counts), agrees (served within bench.tolerance of offline_tau)}}
    offline_text: which text offline_tau is over, in words; offline: its figures (positions, per_position up to max_k,
        tau, tau_request_mean, tau_walk)
    speedup: {T: {batch size: {k: {speedup, spread, repeats, tok_s, baseline_tok_s, served_tau, noisy}}}}: output
        tokens/s with the draft over the target alone, timed A B A B (the target alone, then the draft, on the same
        prompts) so a change of the machine's load hits both; the median of the pairs' ratios, repeated until their
        spread ((max - min) / median) is within bench.tolerance or bench.max_repeats pairs (then noisy)
    serving: results/serve/vllm.json's content (eaglepipe/schedule.py), chosen from the greedy table
    dynamic: {batch size: the chosen schedule's speedup, timed as above, at T = 0}, dynamic_vs_best_static
        ({batch size: its speedup over the best static k's}), confirms (all >= schedule.DYNAMIC_FLOOR); null when the
        schedule never speculates
    diagnosis: when served falls short of offline beyond the tolerance, served tau of the draft with its layer ids
        shifted and the prompts rendered in template variants (diagnose.py), `cause` the fault the best variant undoes,
        `skipped` the variants not tried and why; else null
The prompts served are a seeded random sample of the eval split (bench.seed), not the first by id: ids group by source.
The draft, its offline acceptance, the eval prompts and traces are the workflow's own, or a draft bundle's
(`bench.draft`; the format is in eaglepipe/bundle.py).
"""

from __future__ import annotations

import json
import logging
import random
import statistics
import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

from . import diagnose as diagnose_mod
from . import evaluate, export, provenance, schedule
from .bundle import check_fits
from .chat import load_tokenizer, render_chat
from .engines import open_engine
from .engines.base import EngineSettings, Sampling
from .formats import PROMPT_SCHEMA, read_table, write_json
from .reasoning import read_template
from .target import read_info

log = logging.getLogger(__name__)

@dataclass
class Served:
    """What the bench serves: the draft, the sampled eval conversations, their rendered prompts, the engine settings
    of the target alone (max_num_seqs: the largest batch size) and the layers the draft was trained on."""
    target_dir: str
    draft_dir: str
    ids: list[str]
    conversations: list[list[dict]]
    prompts: list[list[int]]
    base: EngineSettings
    layer_ids: list[int]


def timed(eng, prompts, sampling, batch: int) -> tuple[float, list]:
    """Output tokens/s over the prompts, `batch` at a time, and their generations."""
    start, made = time.monotonic(), []
    for i in range(0, len(prompts), batch):
        made += eng.generate(prompts[i: i + batch], sampling)
    return sum(len(g.output_ids) for g in made) / (time.monotonic() - start), made


def tok_s(eng, prompts, sampling, batch: int) -> float:
    return timed(eng, prompts, sampling, batch)[0]


def spread(ratios: list[float]) -> float:
    return (max(ratios) - min(ratios)) / statistics.median(ratios)


def paired(run_base, run_draft, *, tolerance: float, max_repeats: int) -> dict:
    """The draft's speedup over the target alone from A B pairs (each run_* returns tok/s), repeated until the ratios'
    spread is within the tolerance (two pairs at least) or max_repeats pairs."""
    base, draft = [], []
    while len(base) < max_repeats:
        base.append(run_base())
        draft.append(run_draft())
        ratios = [d / b for d, b in zip(draft, base)]
        if len(ratios) >= 2 and spread(ratios) <= tolerance:
            break
    return {"speedup": statistics.median(ratios), "spread": spread(ratios), "repeats": len(ratios),
            "tok_s": statistics.median(draft), "baseline_tok_s": statistics.median(base),
            "noisy": spread(ratios) > tolerance}


def run_prompts(prompts: list, batch: int, fewest: int) -> list:
    """The prompts of one timed run at this batch size: max(batch, fewest) of the sample, cycled if it is smaller."""
    return [prompts[i % len(prompts)] for i in range(max(batch, fewest))]


def acceptance(eng, served: Served, sampling, batch: int) -> dict:
    """Served tau over every served prompt: pooled from vLLM's counters, and per request."""
    before = eng.spec_counters()
    _, made = timed(eng, served.prompts, sampling, batch)
    tau, drafts, per_pos = diagnose_mod.counted(before, eng.spec_counters())
    per_request = {i: 1 + g.accepted_tokens / g.spec_steps for i, g in zip(served.ids, made) if g.spec_steps}
    return {"served_tau": tau,
            "served_tau_request_mean": statistics.fmean(per_request.values()) if per_request else None,
            "per_request": per_request, "per_position": [p / max(drafts, 1) for p in per_pos], "drafts": drafts}


@dataclass(frozen=True)
class Grid:
    """How the bench times: batch sizes, the fewest prompts of a run, tokens per request, when a cell's pairs stop."""
    batch_sizes: list[int]
    fewest: int
    max_new_tokens: int
    tolerance: float
    max_repeats: int
    seed: int = 0

    def sampling(self, temperature: float = 0) -> Sampling:
        return Sampling(max_new_tokens=self.max_new_tokens, temperature=temperature, seed=self.seed)


def speedups(alone, eng, prompts: list, grid: Grid, temperature: float, label: str) -> dict[str, dict]:
    """One cell per batch size: the speedup of `eng` (a draft served) over `alone` (the target alone) at this
    temperature, and served tau over its timed runs."""
    sampling, row = grid.sampling(temperature), {}
    for b in grid.batch_sizes:
        batch = run_prompts(prompts, b, grid.fewest)
        before = eng.spec_counters()
        cell = paired(partial(tok_s, alone, batch, sampling, b), partial(tok_s, eng, batch, sampling, b),
                      tolerance=grid.tolerance, max_repeats=grid.max_repeats)
        cell["served_tau"] = diagnose_mod.counted(before, eng.spec_counters())[0]
        row[str(b)] = cell
        log.info("%s, T=%s, batch %d: speedup %.2fx (spread %.0f%% over %d pairs; %.1f vs %.1f tok/s)", label,
                 temperature, b, cell["speedup"], 100 * cell["spread"], cell["repeats"], cell["tok_s"],
                 cell["baseline_tok_s"])
    return row


def warm(eng, prompts) -> None:
    eng.generate(prompts[:1], Sampling(max_new_tokens=4))


def serve(served: Served, grid: Grid, *, max_k: int, temperatures: list[float]) -> dict:
    """The k x batch table at each temperature, served acceptance per k, the target's own greedy continuations of the
    prompts, the serving config chosen from the greedy table (vllm.json) and its confirming run. The target alone
    stays loaded throughout, beside one draft engine at a time."""
    out = {"k": {}, "speedup": {str(t): {str(b): {} for b in grid.batch_sizes} for t in temperatures}, "dynamic": None}
    largest = max(grid.batch_sizes)
    with open_engine(served.target_dir, served.base) as alone:
        warm(alone, served.prompts)
        _, out["continuations"] = timed(alone, served.prompts, grid.sampling(), largest)
        for k in range(1, max_k + 1):
            with open_engine(served.target_dir, replace(served.base, draft=served.draft_dir,
                                                        num_speculative_tokens=k)) as eng:
                warm(eng, served.prompts)
                entry = out["k"][str(k)] = acceptance(eng, served, grid.sampling(), largest)
                mean = entry["served_tau_request_mean"]
                log.info("k=%d: served tau %.3f pooled, %s mean over requests (%d drafts)", k, entry["served_tau"],
                         "n/a" if mean is None else f"{mean:.3f}", entry["drafts"])
                for t in temperatures:
                    row = speedups(alone, eng, served.prompts, grid, t, f"k={k}")
                    for b, cell in row.items():
                        out["speedup"][str(t)][b][str(k)] = cell
        out["serving"] = schedule.serving(served.target_dir, served.draft_dir, schedule.table(out["speedup"]["0"]),
                                          0.0)
        config = out["serving"]["speculative_config"]
        if config is not None:
            ranges = config["num_speculative_tokens_per_batch_size"]
            settings = replace(served.base, draft=served.draft_dir, schedule=ranges,
                               num_speculative_tokens=config["num_speculative_tokens"])
            with open_engine(served.target_dir, settings) as eng:
                warm(eng, served.prompts)
                out["dynamic"] = speedups(alone, eng, served.prompts, grid, 0, f"schedule {ranges}")
    return out


def offline(served: Served, continuations, *, engine: dict, max_k: int, context: int) -> dict:
    """Offline acceptance of the draft over the target's own continuations of the served prompts (the text served),
    on hidden states extracted by the workflow's engine at the layers the draft was trained on."""
    rows = evaluate.continuation_rows(served.ids, served.prompts, continuations)
    [result] = evaluate.over_texts(rows, [served.draft_dir], target_dir=served.target_dir, layer_ids=served.layer_ids,
                                   engine=engine, max_k=max_k, max_length=context,
                                   threads=max(engine.get("threads", 1), 1))
    return result


def diagnose(served: Served, k: int, *, offline_tau: float, tolerance: float, n_prompts: int, max_new_tokens: int,
             tokenizer, template_kwargs: dict, traces: list, chat_template, multi_turn: str) -> dict:
    """Served tau of the draft at k with the documented integration faults undone, and the fault that recovers it."""
    prompts = served.prompts[:n_prompts]
    sampling = Sampling(max_new_tokens=max_new_tokens)
    settings = replace(served.base, draft=served.draft_dir, num_speculative_tokens=k)
    traced = _traced_prompt_ids(traces, served.ids[:n_prompts])
    skipped = [f"{name}: {why}" for name, why in diagnose_mod.skipped_variants(multi_turn).items()]
    for line in skipped:
        log.info("diagnosis k=%d: %s", k, line)
    with open_engine(served.target_dir, settings) as eng:
        tau, n, se = diagnose_mod.served_tau(eng, prompts, sampling)
        ids = json.loads((Path(served.draft_dir) / "config.json").read_text())["eagle_config"][
            "eagle_aux_hidden_state_layer_ids"]
        measured = [{"variant": "as served", "kind": "none", "layer_ids": ids, "served_tau": tau, "drafts": n,
                     "std_error": se}]
        own = load_tokenizer(served.target_dir) if chat_template else None
        for name, variant in diagnose_mod.template_variants(tokenizer, served.conversations[:n_prompts],
                                                            template_kwargs, traced, own, multi_turn).items():
            vtau, vn, vse = diagnose_mod.served_tau(eng, variant, sampling)
            log.info("diagnosis k=%d: prompts rendered as '%s' -> served tau %.3f (%d drafts)", k, name, vtau, vn)
            measured.append({"variant": name, "kind": "template", "served_tau": vtau, "drafts": vn, "std_error": vse})
    measured += diagnose_mod.layer_shifts(partial(open_engine, served.target_dir), settings, Path(served.draft_dir),
                                          k=k, prompts=prompts, sampling=sampling,
                                          num_layers=read_info(served.target_dir).num_layers)
    cause = diagnose_mod.name_cause(measured, offline=offline_tau, tolerance=tolerance)
    finding = cause or ("no variant recovers served tau beyond the tolerance and the noise (aux layer ids +-1, chat "
                        "template variants): look at the norm flags, rope settings and max_position_embeddings of the "
                        "draft config, or serve more prompts")
    log.warning("diagnosis k=%d: %s", k, finding)
    return {"k": k, "prompts": len(prompts), "variants": measured, "cause": cause, "finding": finding,
            "skipped": skipped}


def assemble(served: Served, measured: dict, offline_result: dict, acceptance_file: dict, *, tolerance: float,
             max_new_tokens: int) -> dict:
    """served.json's content (the module docstring) from the served table and the offline figures."""
    same = evaluate.subset(acceptance_file, served.ids)
    traces_tau = same["tau"] if same else {}
    ks = {}
    for k, entry in measured["k"].items():
        off = offline_result["tau_walk"].get(k)
        ks[k] = {**entry, "offline_tau": off, "offline_tau_positions": offline_result["tau"].get(k),
                 "offline_tau_request_mean": offline_result["tau_request_mean"].get(k),
                 "offline_tau_traces": traces_tau.get(k),
                 "agrees": off is not None and abs(entry["served_tau"] - off) <= tolerance * off}
    greedy = measured["speedup"]["0"]
    dynamic = measured["dynamic"]
    versus = None if dynamic is None else {
        b: cell["speedup"] / max(c["speedup"] for c in greedy[b].values()) for b, cell in dynamic.items()}
    return {"prompts": len(served.prompts), "served_ids": served.ids, "max_new_tokens": max_new_tokens,
            "batch_sizes": [int(b) for b in greedy], "temperatures": [float(t) for t in measured["speedup"]],
            "max_k": len(ks), "k": ks,
            "offline_text": (f"the target's own greedy continuation ({max_new_tokens} new tokens, as served) of the "
                             f"{len(served.ids)} served conversations"),
            "offline": {key: offline_result[key] for key in ("positions", "per_position", "tau", "tau_request_mean",
                                                             "tau_walk")},
            "speedup": measured["speedup"], "dynamic": dynamic, "dynamic_vs_best_static": versus,
            "confirms": None if versus is None else all(v >= schedule.DYNAMIC_FLOOR for v in versus.values()),
            "diagnosis": None}


def run(prompts_path, draft_dir, acceptance_path, output_path, serving_path, *, target_dir, engine: dict,
        bench: dict, template_kwargs: dict | None = None, traces: list | None = None,
        chat_template: str | None = None, multi_turn: str = "last") -> None:
    """served.json and vllm.json; bench: the config section (config/schema.yaml)."""
    template_kwargs = template_kwargs or {}
    # Before any engine loads: a draft of another target, or one whose files disagree, is named, not served.
    check_fits(draft_dir, target_dir)
    prov = provenance.check(draft_dir, target_dir=target_dir)
    context = min(engine.get("max_model_len", 4096), read_info(target_dir).max_position_embeddings)
    problems = export.check(draft_dir, "vllm", layer_ids=prov["layer_ids"], target_dir=target_dir,
                            serving_context=context)
    if problems:
        raise ValueError("the draft would serve badly in vLLM:\n  " + "\n  ".join(problems))
    acceptance_file = _read_acceptance(acceptance_path)
    # The traces' override template (target.chat_template), when set, is the one served with.
    tokenizer = load_tokenizer(target_dir, read_template(chat_template) if chat_template else None)
    rows = served_rows(read_table(prompts_path, PROMPT_SCHEMA), bench["max_prompts"], bench["seed"])
    conversations = [json.loads(r["messages"]) for r in rows]
    batch_sizes = sorted(set(bench["batch_sizes"]))
    served = Served(
        target_dir=str(target_dir), draft_dir=str(draft_dir), ids=[r["id"] for r in rows], conversations=conversations,
        # rendered as the traces stage did (same template kwargs), so a template fault shows as a shortfall
        prompts=[render_chat(tokenizer, m, template_kwargs) for m in conversations],
        base=EngineSettings.from_config({**engine, "name": "vllm", "batch_size": max(batch_sizes)}),
        layer_ids=prov["layer_ids"])
    temperatures = [0] + ([float(bench["temperature"])] if bench["temperature"] else [])  # keys "0", "0.7"
    log.info("serving %d eval prompts (seed %s): k 1..%d, batch sizes %s, T %s", len(rows), bench["seed"],
             bench["max_k"], batch_sizes, temperatures)
    grid = Grid(batch_sizes=batch_sizes, fewest=bench["run_prompts"], max_new_tokens=bench["max_new_tokens"],
                tolerance=bench["tolerance"], max_repeats=bench["max_repeats"], seed=bench["seed"] or 0)
    measured = serve(served, grid, max_k=bench["max_k"], temperatures=temperatures)
    offline_result = offline(served, measured["continuations"], engine=engine, max_k=bench["max_k"], context=context)
    results = assemble(served, measured, offline_result, acceptance_file, tolerance=bench["tolerance"],
                       max_new_tokens=bench["max_new_tokens"])
    results["seed"] = bench["seed"]
    for k, r in results["k"].items():
        log.info("k=%s: served tau %.3f, offline %.3f over %s", k, r["served_tau"], r["offline_tau"],
                 results["offline_text"])
    short = [k for k, r in results["k"].items() if r["offline_tau"] - r["served_tau"] > bench["tolerance"] *
             r["offline_tau"]]
    if short:
        k = short[0]
        log.warning("k=%s: served tau %.3f falls short of offline %.3f over the same text by more than %.0f%%: "
                    "diagnosing on %d prompts", k, results["k"][k]["served_tau"], results["k"][k]["offline_tau"],
                    100 * bench["tolerance"], bench["diagnose_prompts"])
        if bench["diagnose"]:
            results["diagnosis"] = diagnose(
                served, int(k), offline_tau=results["k"][k]["offline_tau"], tolerance=bench["tolerance"],
                n_prompts=bench["diagnose_prompts"], max_new_tokens=bench["max_new_tokens"], tokenizer=tokenizer,
                template_kwargs=template_kwargs, traces=traces or [], chat_template=chat_template,
                multi_turn=multi_turn)
    results["serving"] = measured["serving"]
    log.info("serving config: %s", results["serving"]["command"])
    if results["dynamic_vs_best_static"]:
        log.info("the schedule against the best static k, by batch size: %s",
                 {b: round(v, 3) for b, v in results["dynamic_vs_best_static"].items()})
    write_json(serving_path, results["serving"])
    write_json(output_path, results)


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
