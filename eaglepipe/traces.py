"""Trace stage: the target regenerates every response; the exact token ids are kept.

One job per (split, shard): a prompt goes to shard hash(id) % num_shards, so shards are independent units of
work. The trace shard format is defined in formats.py.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from . import locks, reasoning
from .engines import open_engine
from .engines.base import EngineSettings, Sampling
from .formats import (
    PROMPT_SCHEMA,
    TRACE_SCHEMA,
    read_table,
    stable_hash,
    write_json,
    write_table,
)
from .logs import Progress
from .target import fingerprint as target_fingerprint
from .resume import Units, resume_key

log = logging.getLogger(__name__)


def shard_of(prompt_id: str, num_shards: int) -> int:
    return stable_hash("shard:" + prompt_id) % num_shards


def run(prompts_path, output_path, **settings) -> None:
    """Generate the trace shard (generate) while holding its lock, so no second run writes it at the same time."""
    with locks.writing(output_path, "trace shard"):
        generate(prompts_path, output_path, **settings)


def generate(prompts_path, output_path, *, target_dir, split: str, shard: int, num_shards: int, engine: dict,
        sampling: dict, template_kwargs: dict, chunk_size: int, max_error_share: float,
        chat_template: str | None = None, reasoning_markers=None, multi_turn: str = "last",
        progress_dir=None) -> None:
    from .chat import load_tokenizer

    prompts = [r for r in read_table(prompts_path, PROMPT_SCHEMA) if shard_of(r["id"], num_shards) == shard]
    template = reasoning.read_template(chat_template) if chat_template else None
    tokenizer = load_tokenizer(target_dir, template)
    markers = reasoning.resolve_markers(reasoning_markers, tokenizer)
    log.info("reasoning markers: %s; multi-turn: %s", markers, multi_turn)
    settings = Sampling(**sampling)
    rows = []
    progress = Progress(f"traces {split}/shard-{shard}", len(prompts), "tok/s")
    # Chunks are the units of resume: a rerun after a crash regenerates only the chunks not yet stored.
    key = resume_key([(r["id"], r["messages"]) for r in prompts], target_fingerprint(target_dir), engine, sampling,
                      template_kwargs, template, markers, multi_turn, chunk_size, str(TRACE_SCHEMA),
                      Path(__file__).read_text(), Path(reasoning.__file__).read_text())
    units = Units(progress_dir or Path(output_path).with_name(f".{Path(output_path).name}.progress"), key,
                  f"traces {split}/shard-{shard}")
    with open_engine(target_dir, EngineSettings.from_config(engine)) as eng:
        # Chunks keep the log speaking and prove on the first chunk that the engine works before the rest runs.
        for start in range(0, len(prompts), chunk_size):
            chunk = slice(start, start + chunk_size)
            stored = units.load(start // chunk_size)
            if stored is not None:
                rows += stored
                progress.update(len(stored), sum(r["output_tokens"] for r in stored))
                continue
            done = reasoning.regenerate(eng, tokenizer, prompts[chunk], settings, split_name=split,
                                        template_kwargs=template_kwargs, markers=markers, multi_turn=multi_turn)
            rows += done
            for row in done:
                if row["error"]:
                    log.warning("prompt %s failed: %s", row["id"], row["error"])
            progress.update(len(done), sum(r["output_tokens"] for r in done))
            if start == 0 and done and all(r["error"] for r in done):
                raise RuntimeError(f"every request of the first chunk failed, e.g.: {done[0]['error']}")
            if not any(r["error"] for r in done):  # a chunk with failures is retried on a rerun: they may be transient
                units.save(start // chunk_size, done)
    errors = sum(1 for r in rows if r["error"])
    if rows and errors / len(rows) > max_error_share:
        raise RuntimeError(f"traces {split}/shard-{shard}: {errors} of {len(rows)} requests failed, more than "
                           f"generation.max_error_share={max_error_share}; see the warnings above for reasons")
    write_table(output_path, rows, TRACE_SCHEMA)
    units.finish(-(-len(prompts) // chunk_size))


LOOP_MAX_PERIOD = 64  # longest repeating cycle looked for at a response's end, in tokens
LOOP_MIN_REPEATS = 3  # a cycle seen this many times in a row ...
LOOP_MIN_TOKENS = 32  # ... covering at least this many tokens is a loop


def trailing_loop(ids: list[int]) -> tuple[int, int]:
    """(period, repeated tokens) of the loop a response ends in, (0, 0) when it ends in none. A loop is a cycle of
    at most LOOP_MAX_PERIOD tokens repeated LOOP_MIN_REPEATS times or more over LOOP_MIN_TOKENS or more at the
    end; its repeated tokens are those after the cycle's first occurrence (a model that loops makes them trivial to
    draft). The period with the most repeated tokens wins, the shortest on a tie."""
    x = np.asarray(ids, dtype=np.int64)
    best = (0, 0)
    for period in range(1, min(LOOP_MAX_PERIOD, len(x) // LOOP_MIN_REPEATS) + 1):
        same = x[period:] == x[:-period]
        run = len(same) if same.all() else int(np.argmin(same[::-1]))  # equal positions counted from the end
        span = run + period
        if span >= max(LOOP_MIN_REPEATS * period, LOOP_MIN_TOKENS) and run > best[1]:
            best = (period, run)
    return best


def length_figures(lengths: list[int]) -> dict:
    """Mean, percentiles and maximum of response lengths in tokens (empty list: zeros)."""
    a = np.asarray(lengths or [0], dtype=np.float64)
    return {"mean": float(a.mean()), **{f"p{q}": float(np.percentile(a, q)) for q in (10, 50, 90, 99)},
            "max": int(a.max())}


def stats(shard_paths: list[str], output_path) -> None:
    """Aggregate figures of all trace shards: samples, errors, truncation, tokens, the response length distribution,
    responses that end in a loop (trailing_loop), reasoning capture."""
    out = {}
    for split in ("train", "eval"):
        rows = [r for p in shard_paths for r in read_table(p, TRACE_SCHEMA) if r["split"] == split]
        ok = [r for r in rows if not r["error"]]
        loops = [trailing_loop(r["output_ids"]) for r in ok]
        out[split] = {
            **reasoning.stats(rows),
            "samples": len(rows), "errors": len(rows) - len(ok),
            "truncated_share": sum(r["finish_reason"] == "length" for r in ok) / max(len(ok), 1),
            "prompt_tokens": sum(r["prompt_tokens"] for r in ok),
            "output_tokens": sum(r["output_tokens"] for r in ok),
            "response_tokens": length_figures([r["output_tokens"] for r in ok]),
            "looping_share": sum(period > 0 for period, _ in loops) / max(len(ok), 1),
            "looping_token_share": sum(n for _, n in loops) / max(sum(r["output_tokens"] for r in ok), 1),
        }
    write_json(output_path, out)
