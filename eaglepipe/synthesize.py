"""Synthesized prompts (the technique published as Magpie): the target writes its own user prompts.

The target is fed only its chat template's prefix up to where a user's text starts ([optional system turn, user
turn] rendered without the generation prompt and cut where the user's text begins), and samples until it ends the
turn (the engine stops on the target's end-of-sequence ids, which hold the end-of-turn token for ChatML, Llama-3
and Qwen targets). Each sample is then filtered, in this order, and counted under the first filter it fails:

    error            the engine reported a failure for the request
    truncated        the sample reached max_new_tokens without ending its turn
    empty            nothing but whitespace
    non_text         holds a special token of the template (<|im_start|>, ...), control characters or undecodable
                     bytes, or too few letters among its visible characters (min_letter_share)
    over_long        more than max_prompt_tokens tokens
    exact_duplicate  the same text as an earlier kept sample, after Unicode (NFKC), case and whitespace normalisation
    near_duplicate   a Jaccard similarity of word 3-grams >= near_duplicate_threshold with an earlier kept sample
                     (candidates found by MinHash with LSH banding, then the Jaccard computed exactly; deterministic)

Single user turns only: multi-turn synthesis (the target answering, then writing the next user turn) is not built.
Sampling is seeded per chunk of `chunk_size` requests (the chunk's seed derives from `seed` and the chunk number), so
the same settings give the same prompts byte for byte, and chunks are the units of resume (eaglepipe/resume.py).
"""

from __future__ import annotations

import hashlib
import logging
import re
import unicodedata
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa

from .formats import stable_hash, write_json, write_table
from .logs import Progress
from .resume import Units, resume_key

log = logging.getLogger(__name__)

SENTINEL = "EAGLEPIPE_SYNTHESIZED_USER_TEXT_7f3a"
FILTERS = ("error", "truncated", "empty", "non_text", "over_long", "exact_duplicate", "near_duplicate")
SYNTH_SCHEMA = pa.schema([("id", pa.string()), ("prompt", pa.string()), ("sample", pa.int64()),
                          ("tokens", pa.int32())])
SOURCE_NAME = "synthesized"


class SynthesizeError(ValueError):
    pass


def check_settings(settings: dict) -> None:
    """Clear errors for settings the schema cannot express or that callers outside the workflow may pass."""
    share = settings.get("share")
    if share is not None and not (isinstance(share, (int, float)) and 0 < share <= 1):
        raise SynthesizeError(f"config key prompts.synthesize.share: {share!r} is out of range; give the share of "
                              "synthesized prompts in the mixed set, a number in (0, 1] (1 uses no prompt files), "
                              "or null to keep every prompt of both kinds")
    if not settings.get("count", 0) >= 1:
        raise SynthesizeError(f"config key prompts.synthesize.count: {settings.get('count')!r}; give the number of "
                              "samples to draw, at least 1")
    if not settings.get("temperature", 0) > 0:
        raise SynthesizeError(f"config key prompts.synthesize.temperature: {settings.get('temperature')!r}; must be "
                              "above 0 (greedy decoding writes the same prompt every time)")
    if not 0 < settings.get("top_p", 0) <= 1:
        raise SynthesizeError(f"config key prompts.synthesize.top_p: {settings.get('top_p')!r}; must be in (0, 1]")
    if not 0 < settings.get("near_duplicate_threshold", 0) <= 1:
        raise SynthesizeError("config key prompts.synthesize.near_duplicate_threshold: "
                              f"{settings.get('near_duplicate_threshold')!r}; must be in (0, 1]")


def user_prefix(tokenizer, system_prompt: str | None = None, template_kwargs: dict | None = None) -> list[int]:
    """Token ids of the chat template up to where the user's text starts: [system turn if given, user turn]
    rendered without the generation prompt and cut at the user's text."""
    from .chat import render_chat

    if not tokenizer.chat_template:
        raise SynthesizeError(f"prompts.synthesize needs a chat template, and the target {tokenizer.name_or_path} "
                              "has none: set config key target.chat_template to a Jinja template file, or set "
                              "prompts.synthesize.enabled to false")
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
        {"role": "user", "content": SENTINEL}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                         **(template_kwargs or {}))
    if SENTINEL not in text:
        raise SynthesizeError("the chat template (target.chat_template or the target's own) does not write the "
                              "user's text as given, so its user-turn prefix cannot be found; prompts.synthesize "
                              "needs a template that renders message content verbatim")
    ids = tokenizer(text[: text.index(SENTINEL)], add_special_tokens=False)["input_ids"]
    full = render_chat(tokenizer, messages, template_kwargs, generation_prompt=False)
    same = 0  # the prefix must be what the template's own tokenization starts with
    while same < min(len(ids), len(full)) and ids[same] == full[same]:
        same += 1
    if same < len(ids):
        log.warning("the user-turn prefix tokenizes differently alone (%d tokens) than in the template (first %d "
                    "agree); using the %d that agree", len(ids), same, same)
    if same == 0:
        raise SynthesizeError("the chat template's user-turn prefix is empty; prompts.synthesize needs a template "
                              "that writes a user-turn header")
    return [int(i) for i in full[:same]]


def special_strings(tokenizer) -> list[str]:
    """The tokenizer's special tokens as text: a prompt that holds one leaks the template."""
    found = set(tokenizer.all_special_tokens)
    found |= {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special}
    return sorted(s for s in found if len(s) >= 2)


def normalise_text(text: str) -> str:
    """The text compared by the exact-duplicate filter: NFKC, case-folded, whitespace runs as one space."""
    return re.sub(r"\s+", " ", unicodedata.normalize("NFKC", text).casefold()).strip()


def non_text_reason(text: str, specials: list[str], min_letter_share: float) -> str | None:
    """Why `text` is not a plain-text prompt, or None when it is."""
    for token in specials:
        if token in text:
            return f"holds the template token {token!r}"
    if "\ufffd" in text:
        return "holds undecodable bytes"
    for c in text:
        if unicodedata.category(c) == "Cc" and c not in "\n\t\r":
            return f"holds the control character {c!r}"
    visible = [c for c in text if not c.isspace()]
    letters = sum(c.isalpha() for c in visible)
    if visible and letters / len(visible) < min_letter_share:
        return f"letters are {letters} of {len(visible)} visible characters"
    return None


MASK64 = (1 << 64) - 1


def _mix(x: np.ndarray) -> np.ndarray:
    """A 64-bit finaliser (splitmix64): spreads combined word hashes over all bits; wraps like unsigned C."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def shingles(text: str, n: int = 3, cache: dict | None = None) -> set[int]:
    """The word n-grams of the normalised text (words: runs of letters and digits) as 64-bit hashes; a text of
    fewer than n words gives one n-gram of all its words, one without words the hash of its normalised text.
    Deterministic: words hash by crc32, n-grams as tuples of ints (Python salts only str and bytes hashes)."""
    cache = {} if cache is None else cache
    norm = normalise_text(text)
    words = [cache.get(w) or cache.setdefault(w, zlib.crc32(w.encode()) + 1) for w in re.findall(r"\w+", norm)]
    words = words or [zlib.crc32(norm.encode()) + 1]
    k = min(n, len(words))
    return {hash(tuple(words[i: i + k])) & MASK64 for i in range(len(words) - k + 1)}


class NearDuplicates:
    """Greedy near-duplicate removal in input order: a text is dropped when the Jaccard similarity of its word
    3-gram set with that of an earlier kept text is at least `threshold`. MinHash (num_perm multiply-shift hashes,
    bands of `rows`) finds the candidates; the Jaccard of each candidate is then computed exactly, so the
    threshold holds exactly and only pairs near it can be missed (at 0.7 with 128 hashes in bands of 4, a pair
    is missed with probability 1 in ~7,000). 50,000 prompts take seconds."""

    def __init__(self, threshold: float = 0.7, num_perm: int = 63, rows: int = 3):
        self.threshold, self.rows, self.bands = threshold, rows, num_perm // rows
        rng = np.random.default_rng(0)
        self.a = rng.integers(1, 1 << 63, size=num_perm, dtype=np.uint64) | np.uint64(1)  # odd multipliers
        self.b = rng.integers(0, 1 << 63, size=num_perm, dtype=np.uint64)

    def signatures(self, sets: list[set[int]]) -> np.ndarray:
        """[texts, num_perm] minimum of each hash over each text's n-grams."""
        out = np.empty((len(sets), len(self.a)), dtype=np.uint64)
        block = 512  # texts per vectorised step: bounded memory at any count
        with np.errstate(over="ignore"):
            for start in range(0, len(sets), block):
                part = sets[start: start + block]
                lengths = [len(s) for s in part]
                flat = np.fromiter((h for s in part for h in s), dtype=np.uint64, count=sum(lengths))
                hashed = (flat[:, None] * self.a + self.b) >> np.uint64(32)
                offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
                out[start: start + len(part)] = np.minimum.reduceat(hashed, offsets, axis=0)
        return out

    def band_keys(self, signatures: np.ndarray) -> list[list[int]]:
        """[texts][bands] one 64-bit key per band (its rows' values and the band number, mixed)."""
        keys = np.zeros((len(signatures), self.bands), dtype=np.uint64)
        with np.errstate(over="ignore"):
            for r in range(self.rows):
                keys = _mix(keys ^ signatures[:, r::self.rows][:, : self.bands])
            keys = _mix(keys ^ np.arange(self.bands, dtype=np.uint64))
        return keys.tolist()

    def keep(self, texts: list[str]) -> list[bool]:
        cache: dict[str, int] = {}
        sets = [shingles(t, cache=cache) for t in texts]
        keys = self.band_keys(self.signatures(sets)) if texts else []
        buckets: dict[int, list[int]] = {}
        kept = []
        for i, s in enumerate(sets):
            candidates = sorted({j for key in keys[i] for j in buckets.get(key, ())})
            duplicate = False
            for j in candidates:
                common = len(s & sets[j])
                if common / (len(s) + len(sets[j]) - common) >= self.threshold:
                    duplicate = True
                    break
            kept.append(not duplicate)
            if not duplicate:
                for key in keys[i]:
                    buckets.setdefault(key, []).append(i)
        return kept

    def matches(self, queries: list[str], corpus: list[str]) -> list[int | None]:
        """For each query, the lowest index of a corpus text it is a near-duplicate of (the test keep() applies),
        None when there is none."""
        cache: dict[str, int] = {}
        sets = [shingles(t, cache=cache) for t in corpus + queries]
        keys = self.band_keys(self.signatures(sets)) if sets else []
        buckets: dict[int, list[int]] = {}
        for i in range(len(corpus)):
            for key in keys[i]:
                buckets.setdefault(key, []).append(i)
        out = []
        for i in range(len(corpus), len(sets)):
            found = None
            for j in sorted({j for key in keys[i] for j in buckets.get(key, ())}):
                common = len(sets[i] & sets[j])
                if common / (len(sets[i]) + len(sets[j]) - common) >= self.threshold:
                    found = j
                    break
            out.append(found)
        return out


def prompt_id(text: str) -> str:
    return "syn-" + hashlib.sha256(text.encode()).hexdigest()[:16]


def filter_samples(samples: list[dict], tokenizer, *, max_prompt_tokens: int, min_letter_share: float,
                   near_duplicate_threshold: float, eos_ids: set[int] | None = None) -> tuple[list[dict], dict]:
    """Kept prompt rows (SYNTH_SCHEMA) and the count each filter rejected. A sample is
    {"sample", "output_ids", "finish_reason", "error"}."""
    specials = special_strings(tokenizer)
    eos_ids = set(eos_ids or ()) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
    counts = dict.fromkeys(FILTERS, 0)
    candidates, seen = [], set()
    for sample in samples:
        ids = list(sample["output_ids"])
        if sample["error"]:
            counts["error"] += 1
            continue
        if sample["finish_reason"] != "stop":
            counts["truncated"] += 1
            continue
        if ids and ids[-1] in eos_ids:
            ids = ids[:-1]
        text = tokenizer.decode(ids, skip_special_tokens=False).strip()
        if not text:
            counts["empty"] += 1
        elif non_text_reason(text, specials, min_letter_share):
            counts["non_text"] += 1
        elif len(ids) > max_prompt_tokens:
            counts["over_long"] += 1
        elif normalise_text(text) in seen:
            counts["exact_duplicate"] += 1
        else:
            seen.add(normalise_text(text))
            candidates.append({"id": prompt_id(text), "prompt": text, "sample": int(sample["sample"]),
                               "tokens": len(ids)})
    keep = NearDuplicates(near_duplicate_threshold).keep([c["prompt"] for c in candidates])
    counts["near_duplicate"] = keep.count(False)
    return [c for c, k in zip(candidates, keep) if k], counts


def chunk_seed(seed: int, chunk: int) -> int:
    """The sampling seed of chunk `chunk`: distinct per chunk (identical requests in two chunks differ)."""
    return stable_hash(f"synthesize:{seed}:{chunk}") % (1 << 31)


def run(output_prompts, output_counts, *, target_dir, engine: dict, settings: dict, template_kwargs: dict,
        chat_template: str | None = None, progress_dir=None) -> None:
    """Draw settings["count"] samples from the target's user-turn prefix, filter them, write the kept prompts
    (SYNTH_SCHEMA) and the counts per filter (JSON)."""
    from .chat import load_tokenizer
    from .engines import open_engine
    from .engines.base import EngineSettings, Sampling
    from .reasoning import read_template
    from .target import fingerprint as target_fingerprint

    check_settings(settings)
    template = read_template(chat_template) if chat_template else None
    tokenizer = load_tokenizer(target_dir, template)
    prefix = user_prefix(tokenizer, settings["system_prompt"], template_kwargs)
    log.info("user-turn prefix (%d tokens): %r", len(prefix), tokenizer.decode(prefix))
    count, chunk_size = settings["count"], settings["chunk_size"]
    chunks = -(-count // chunk_size)
    sampling_keys = ("max_new_tokens", "temperature", "top_p", "seed")
    key = resume_key(target_fingerprint(target_dir), engine, {k: settings[k] for k in sampling_keys}, chunk_size,
                      count, prefix, Path(__file__).read_text())
    units = Units(progress_dir or Path(output_prompts).with_name(f".{Path(output_prompts).name}.progress"), key,
                  "synthesize")
    progress = Progress("synthesize", count, "tok/s")
    samples: list[dict] = []
    with open_engine(target_dir, EngineSettings.from_config(engine)) as eng:
        eos_ids = set(getattr(eng, "eos_ids", ()))
        for chunk in range(chunks):
            done = units.load(chunk)
            if done is None:
                n = min(chunk_size, count - chunk * chunk_size)
                sampling = Sampling(max_new_tokens=settings["max_new_tokens"], temperature=settings["temperature"],
                                    top_p=settings["top_p"], seed=chunk_seed(settings["seed"], chunk))
                generations = eng.generate([list(prefix) for _ in range(n)], sampling)
                done = [{"sample": chunk * chunk_size + j, "output_ids": [int(t) for t in g.output_ids],
                         "finish_reason": g.finish_reason, "error": g.error} for j, g in enumerate(generations)]
                if chunk == 0 and all(d["error"] for d in done):
                    raise RuntimeError(f"synthesize: every request of the first chunk failed, e.g.: {done[0]['error']}")
                outputs = {tuple(d["output_ids"]) for d in done if not d["error"]}
                if n >= 8 and len(outputs) == 1:
                    raise RuntimeError(f"synthesize: engine {engine.get('name')!r} returned the same sample for all "
                                       f"{n} requests of chunk {chunk}: it seeds every request of a call alike, and "
                                       "synthesis sends identical requests; it needs an engine that seeds each "
                                       "request on its own")
                if not any(d["error"] for d in done):  # a chunk with failures is retried on a rerun
                    units.save(chunk, done)
            samples += done
            progress.update(len(done), sum(len(d["output_ids"]) for d in done))
    rows, rejected = filter_samples(samples, tokenizer, max_prompt_tokens=settings["max_prompt_tokens"],
                                    min_letter_share=settings["min_letter_share"],
                                    near_duplicate_threshold=settings["near_duplicate_threshold"], eos_ids=eos_ids)
    for sample in samples:
        if sample["error"]:
            log.warning("sample %d failed: %s", sample["sample"], sample["error"])
    if not rows:
        raise RuntimeError(f"synthesize: none of {len(samples)} samples passed the filters ({rejected}); see "
                           "config/README.md, prompts.synthesize")
    write_table(output_prompts, rows, SYNTH_SCHEMA)
    write_json(output_counts, {
        "requested": count, "kept": len(rows), "rejected": rejected, "prefix_tokens": len(prefix),
        "kept_tokens": sum(r["tokens"] for r in rows), "multi_turn": False,
        "settings": {k: settings[k] for k in sorted(settings) if k not in ("enabled", "share")},
    })
    log.info("synthesize: kept %d of %d samples; rejected %s", len(rows), len(samples),
             ", ".join(f"{k} {v}" for k, v in rejected.items()))
    units.finish(chunks)
