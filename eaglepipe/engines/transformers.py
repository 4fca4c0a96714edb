"""The reference engine on Hugging Face transformers: runs everywhere (CPU, CUDA), checks the others."""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Iterator

import torch

from ..chat import load_tokenizer
from ..formats import STATE_DTYPES, encode
from . import fast
from .base import Capture, Engine, EngineSettings, Generation, Rows, Sampling, group_ranges

log = logging.getLogger(__name__)

RETRY_PROBE = 2  # items retried alone after a batch fails before a shared cause is assumed

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def split_seed(seed: int, half: int) -> int:
    """The seed of one half of a split batch: a multiplicative hash of the batch's, so it meets no other batch's
    (those are the run's seed plus the batch number) the way 2 seed + 1 would."""
    return (seed * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019 * (half + 1)) % 2**63


class TransformersEngine(Engine):
    def __init__(self, target_dir, settings: EngineSettings):
        from transformers import AutoModelForCausalLM

        if settings.threads:
            torch.set_num_threads(settings.threads)
        if settings.device.startswith("cuda") and not torch.cuda.is_available():
            raise RuntimeError("config key engine.device is 'cuda' but torch sees no CUDA device; "
                               "set engine.device: cpu or run on a GPU machine")
        model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=DTYPES[settings.dtype])
        self.setup(model.to(settings.device), load_tokenizer(target_dir), settings)

    def setup(self, model, tokenizer, settings: EngineSettings) -> None:
        """Take a loaded model (and its tokenizer; None for a model without one, e.g. a benchmark's random target)."""
        self.settings = settings
        self.device = torch.device(settings.device)
        self.tokenizer = tokenizer
        self.model = model.eval()
        self.eos_ids = self._eos_ids()
        pad = tokenizer.pad_token_id if tokenizer is not None else None
        self.pad_id = pad if pad is not None else self.eos_ids[0]
        self.fast = self._fast_path()
        self._ring, self._ring_busy = None, False  # capture_rows' host buffers, and whether a capture holds them

    def _fast_path(self):
        """The decoder of fast.py when engine.fast_path asks for it (auto: on CUDA, for the layer layouts it knows)."""
        choice = self.settings.fast_path
        if choice is False or (choice == "auto" and self.device.type != "cuda"):
            return None
        if not fast.supports(self.model):
            if choice is True:
                raise ValueError(f"config key engine.fast_path: true, but the fast path does not run model type "
                                 f"{self.model.config.model_type!r} (it runs {sorted(fast.SUPPORTED)}); set it to "
                                 "auto or off")
            log.info("fast path off: model type %s is not one it runs", self.model.config.model_type)
            return None
        decoder = fast.Decoder(self.model)
        log.info("fast path on (%s, %s)", self.device, self.settings.dtype)
        if self.device.type == "cuda" and not decoder.uses_varlen():
            log.warning("hidden-state capture on %s runs one attention call per sequence (no varlen flash kernel "
                        "for this device, dtype %s or torch %s): correct, but slow", self.device,
                        self.settings.dtype, torch.__version__)
        return decoder

    def _eos_ids(self) -> list[int]:
        eos = self.model.generation_config.eos_token_id
        if eos is None and self.tokenizer is not None:
            eos = self.tokenizer.eos_token_id
        if eos is None:
            return [0]
        return sorted({int(e) for e in (eos if isinstance(eos, list) else [eos])})

    def close(self) -> None:
        del self.model
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _batches(self, sequences: list[list[int]], max_rows=None, max_tokens=None):
        """Index batches by length (similar lengths pad least), bounded in sequences and padded tokens; max_rows may be
        a function of the batch's longest sequence (the fast path's memory bound)."""
        max_rows = max_rows or (lambda longest: self.settings.batch_size)
        max_tokens = max_tokens or self.settings.max_batch_tokens
        order = sorted(range(len(sequences)), key=lambda i: (len(sequences[i]), i))
        batch: list[int] = []
        for i in order:
            longest = len(sequences[i])  # ascending order: the newest is the longest
            if batch and (len(batch) >= max_rows(longest) or longest * (len(batch) + 1) > max_tokens):
                yield batch
                batch = []
            batch.append(i)
        if batch:
            yield batch

    def _packed(self, sequences: list[list[int]], group: range):
        """Consecutive sequences of group, in order, while they add up to at most max_batch_tokens tokens (a longer
        sequence is a batch of its own). No bound in sequences: without padding, tokens alone size the batch."""
        batch, tokens = [], 0
        for i in group:
            n = len(sequences[i])
            if batch and tokens + n > self.settings.max_batch_tokens:
                yield batch
                batch, tokens = [], 0
            batch.append(i)
            tokens += n
        if batch:
            yield batch

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[Generation]:
        results: list[Generation | None] = [None] * len(prompts)
        vocab = self.model.config.get_text_config().vocab_size
        for i, p in enumerate(prompts):  # rejected here: the embedding lookup would fail with an unclear IndexError
            outside = [t for t in p if not 0 <= t < vocab]
            if outside:
                results[i] = Generation(prompt_ids=list(p), error=f"rejected: prompt token id {outside[0]} is outside "
                                        f"the target's vocabulary of {vocab}")
        valid = [i for i, r in enumerate(results) if r is None]
        plan = self._batches([prompts[i] for i in valid])
        if self.fast is not None:  # prefill runs in row groups, so a batch is bounded by cache memory, not by tokens
            fits = fast.rows_that_fit(self.fast, self.settings.batch_size)
            plan = self._batches([prompts[i] for i in valid], max_rows=lambda n: fits(n + sampling.max_new_tokens),
                                 max_tokens=float("inf"))
        plan = list(plan)
        started, made = time.monotonic(), 0
        for batch_no, sub in enumerate(plan):
            batch = [valid[j] for j in sub]
            try:
                outs = self._generate_fitting([prompts[i] for i in batch], sampling, seed=sampling.seed + batch_no)
            except (RuntimeError, ValueError) as err:  # one bad item must not sink its batch: retry one by one
                log.warning("batch of %d failed (%s); retrying items one by one", len(batch), err)
                outs = []
                for n, i in enumerate(batch):
                    try:
                        outs += self._generate_batch([prompts[i]], sampling, seed=sampling.seed + i)
                    except (RuntimeError, ValueError) as item_err:
                        outs.append(Generation(prompt_ids=list(prompts[i]), error=str(item_err)))
                        if n == RETRY_PROBE - 1 and all(o.error for o in outs):
                            # Not one bad item: every item fails alone too. Fail the rest at once with the reason
                            # rather than spend the batch's time on retries that fail the same way.
                            log.error("the first %d items of the batch failed alone too (%s); failing the batch",
                                      RETRY_PROBE, item_err)
                            outs += [Generation(prompt_ids=list(prompts[j]), error=f"batch failed: {err}")
                                     for j in batch[n + 1:]]
                            break
            for i, out in zip(batch, outs):
                results[i] = out
            made += sum(len(o.output_ids) for o in outs)
            elapsed = time.monotonic() - started
            log.info("generate: batch %d/%d of %d rows done, %d new tokens so far, %.0f tok/s", batch_no + 1,
                     len(plan), len(batch), made, made / max(elapsed, 1e-9))
        return results

    def _generate_fitting(self, prompts: list[list[int]], sampling: Sampling, seed: int) -> list[Generation]:
        """One batch, run in halves (recursively) while the device runs out of memory: a batch sized past the device
        costs a few failed attempts, not a retry of every item alone. The halves' seeds derive from the batch's
        (split_seed), so a rerun on the same device splits and samples the same way."""
        try:
            return self._generate_batch(prompts, sampling, seed=seed)
        except torch.OutOfMemoryError:
            if len(prompts) == 1:
                raise
        # Outside the except clause: its traceback holds the failed attempt's tensors until the clause ends.
        half = len(prompts) // 2
        log.warning("a batch of %d rows ran out of device memory; running it as %d + %d rows", len(prompts), half,
                    len(prompts) - half)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return (self._generate_fitting(prompts[:half], sampling, split_seed(seed, 0))
                + self._generate_fitting(prompts[half:], sampling, split_seed(seed, 1)))

    def _generate_batch(self, prompts: list[list[int]], sampling: Sampling, seed: int) -> list[Generation]:
        if self.fast is not None:
            outs = self.fast.generate(prompts, max_new_tokens=sampling.max_new_tokens, eos_ids=self.eos_ids,
                                      pad_id=self.pad_id, temperature=sampling.temperature, top_p=sampling.top_p,
                                      seed=seed, prefill_tokens=self.settings.max_batch_tokens)
            return [Generation(prompt_ids=list(p), output_ids=ids, finish_reason=finish)
                    for p, (ids, finish) in zip(prompts, outs)]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(prompts):  # left padding: every prompt ends where generation starts
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        greedy = sampling.temperature == 0
        # generate() samples from the global generators: seed them for this batch only, leaving the caller's state
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(seed)
            out = self.model.generate(
                input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                max_new_tokens=sampling.max_new_tokens, do_sample=not greedy,
                temperature=None if greedy else sampling.temperature, top_p=None if greedy else sampling.top_p,
                top_k=None, eos_token_id=self.eos_ids, pad_token_id=self.pad_id,
            ).cpu()
        results = []
        for row, p in enumerate(prompts):
            new = out[row, width:].tolist()
            finish = "length"
            for pos, tok in enumerate(new):
                if tok in self.eos_ids:
                    new, finish = new[: pos + 1], "stop"  # keep the end token: the target emits it
                    break
            results.append(Generation(prompt_ids=list(p), output_ids=new, finish_reason=finish))
        return results

    @torch.inference_mode()
    def capture(self, sequences: list[list[int]], layer_ids: list[int]) -> list[Capture]:
        if self.fast is not None:
            return self._capture_fast(sequences, layer_ids)
        results: list[Capture | None] = [None] * len(sequences)
        for batch in self._batches(sequences):
            width = max(len(sequences[i]) for i in batch)
            ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, i in enumerate(batch):  # right padding: positions of real tokens are 0..len-1
                ids[row, : len(sequences[i])] = torch.tensor(sequences[i])
                mask[row, : len(sequences[i])] = 1
            out = self.model.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                   output_hidden_states=True)
            # hidden_states[k] is the input of layer k for k < N; last_hidden_state is after the final norm.
            aux = torch.stack([out.hidden_states[k] for k in layer_ids], dim=2).to("cpu", torch.bfloat16)
            final = out.last_hidden_state.to("cpu", torch.bfloat16)
            for row, i in enumerate(batch):
                n = len(sequences[i])
                results[i] = Capture(aux=aux[row, :n].clone(), final=final[row, :n].clone())
        return results

    def _capture_fast(self, sequences: list[list[int]], layer_ids: list[int]) -> list[Capture]:
        """One Capture per sequence, split (and copied) from the batches of capture_rows."""
        results: list[Capture | None] = [None] * len(sequences)
        for rows in self.capture_rows(sequences, layer_ids):
            at = 0
            for i in rows.indices:
                n = len(sequences[i])
                results[i] = Capture(aux=rows.aux[at: at + n].clone(), final=rows.final[at: at + n].clone())
                at += n
            rows.release()
        return results

    @torch.inference_mode()
    def capture_rows(self, sequences: list[list[int]], layer_ids: list[int], groups: list[int] | None = None,
                     dtype: str = "bfloat16") -> Iterator[Rows]:
        """The fast path: packed batches (consecutive sequences of a group, one after another, up to
        engine.max_batch_tokens tokens: no padding, and each batch is one run of shard rows), encoded in the shard's
        dtype on the device (fp8: half the bytes to copy), copied without blocking into a ring of host buffers
        (pinned on CUDA) allocated once; a batch is handed out once its copy is done, while the device runs the next
        one."""
        if self.fast is None:
            yield from super().capture_rows(sequences, layer_ids, groups, dtype)
            return
        plan = [batch for group in group_ranges(len(sequences), groups) for batch in self._packed(sequences, group)]
        if not plan:
            return
        pin = self.device.type == "cuda"
        most = max(sum(len(sequences[i]) for i in batch) for batch in plan)
        hidden = self.model.config.hidden_size
        if self._ring_busy:  # a capture inside another's loop: its own buffers, or the two would wait on each other
            ring = _Ring(RING_DEPTH, most, len(layer_ids), hidden, pin, dtype)
        else:
            if self._ring is None or not self._ring.fits(most, len(layer_ids), hidden, dtype):
                self._ring = None  # buffers still held by a consumer stay alive until it lets go of them
                self._ring = _Ring(RING_DEPTH, most, len(layer_ids), hidden, pin, dtype)
            ring, self._ring_busy = self._ring, True
        pending = taken = None
        try:
            for batch in plan:
                bufs, release = ring.take()
                taken = (batch, bufs, release, _Done())  # released below if the forward fails
                ids = torch.tensor([t for i in batch for t in sequences[i]], dtype=torch.long)
                # non_blocking from pageable memory: staged at once, without waiting for the batch still running
                aux, final = self.fast.hidden_states(ids.to(self.device, non_blocking=True),
                                                     [len(sequences[i]) for i in batch], layer_ids)
                n = ids.numel()
                encoded = (*encode(aux, dtype), *encode(final, dtype))  # aux, its scale, final, its scale
                for buf, t in zip(bufs, encoded):
                    if buf is not None:
                        buf[:n].copy_(t, non_blocking=pin)
                done = torch.cuda.Event() if pin else _Done()
                if pin:
                    done.record()
                taken = None
                previous, pending = pending, (batch, [b if b is None else b[:n] for b in bufs], release, done)
                if previous is not None:
                    yield _finish(*previous)  # the consumer's from here on: it releases it
            last, pending = pending, None
            yield _finish(*last)
        finally:  # closed early or failed: buffers not handed out go back to the ring
            for held in (taken, pending):
                if held is not None:
                    held[3].synchronize()  # no copy may still be writing into it
                    held[2]()
            if ring is self._ring:
                self._ring_busy = False


RING_DEPTH = 3  # host buffers: one being filled, one handed out, one still being written by the consumer


def _finish(batch, bufs, release, done) -> Rows:
    done.synchronize()
    aux, aux_scale, final, final_scale = bufs
    return Rows(batch, aux, final, release, aux_scale=aux_scale, final_scale=final_scale)


class _Ring:
    """Host buffers for captured rows, allocated once per engine (pinned memory is slow to allocate: ~1 s per GB) and
    reused in turn: a slot is handed out again only after the consumer released the Rows that used it. Each slot is
    allocated when first taken, so all but the first are pinned while the device runs the first batches."""

    def __init__(self, depth: int, rows: int, n_aux: int, hidden: int, pin: bool, dtype: str = "bfloat16"):
        self.shape, self.pin, self.dtype = (rows, n_aux, hidden), pin, dtype
        self.slots = [None] * depth
        self.free = [threading.Event() for _ in range(depth)]
        for free in self.free:
            free.set()
        self.next = 0

    def fits(self, rows: int, n_aux: int, hidden: int, dtype: str = "bfloat16") -> bool:
        return rows <= self.shape[0] and (n_aux, hidden) == self.shape[1:] and dtype == self.dtype

    def take(self, patience: float = 3600.0):
        at = self.next
        self.next = (self.next + 1) % len(self.slots)
        free = self.free[at]
        if not free.wait(patience):
            raise RuntimeError(f"capture_rows: no host buffer released within {patience:.0f} s; a consumer of Rows "
                               "must call rows.release() once done with them")
        free.clear()
        if self.slots[at] is None:
            rows, n_aux, hidden = self.shape
            values, scaled = STATE_DTYPES[self.dtype], self.dtype != "bfloat16"

            def buffer(shape, dtype=values):
                return torch.empty(shape, dtype=dtype, pin_memory=self.pin)

            # aux, its scales, final, its scales (formats.encode's order; no scales for bf16)
            self.slots[at] = (buffer((rows, n_aux, hidden)), buffer((rows, n_aux), torch.float32) if scaled else None,
                              buffer((rows, hidden)), buffer((rows,), torch.float32) if scaled else None)
        return self.slots[at], free.set


class _Done:
    """A CPU stand-in for a CUDA event: CPU work is complete when it returns."""

    def synchronize(self) -> None:
        pass
