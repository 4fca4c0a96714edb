"""The engine interface: the one door through which the pipeline runs a target model.

An engine is a context manager (start on enter; processes and memory released on exit, success or failure) with:
    generate(prompts, sampling) -> one Generation per prompt (failures reported per item, never raised for all)
    capture(sequences, layer_ids) -> one Capture per sequence, ids in "input of layer k" numbering
    capture_rows(sequences, layer_ids, groups, dtype) -> Rows of whole batches in a shard's dtype (formats.encode), for
        a stage that writes them out as they come
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from ..config import defaults
from ..formats import encode


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    seed: int = 0


@dataclass
class Generation:
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str = "error"  # "stop" (end-of-sequence token), "length" (max_new_tokens) or "error"
    error: str = ""
    # Speculative decoding (vLLM with a draft): this request's verify steps and draft tokens the target accepted
    spec_steps: int = 0
    accepted_tokens: int = 0


@dataclass
class Capture:
    aux: torch.Tensor  # [T, n_aux, H] bf16: input of each requested layer
    final: torch.Tensor  # [T, H] bf16: the final hidden state after the target's final norm


def _nothing() -> None:
    pass


@dataclass
class Rows:
    """The captured rows of one batch: the sequences `indices` (into the list given to capture_rows), their tokens
    one after another in that order (aux [rows, n_aux, H], final [rows, H] on the host, in the dtype asked for; with
    fp8 their scales aux_scale [rows, n_aux], final_scale [rows]). The tensors may be views into a buffer the engine
    reuses: call release() once done with them (from any thread); until then the engine may wait for the buffer."""
    indices: list[int]
    aux: torch.Tensor
    final: torch.Tensor
    release: Callable[[], None] = _nothing
    aux_scale: torch.Tensor | None = None
    final_scale: torch.Tensor | None = None


def group_ranges(count: int, groups: list[int] | None) -> list[range]:
    """Consecutive ranges of sequence indices of the given sizes (None: one range of all `count`)."""
    sizes = [count] if groups is None else list(groups)
    if sum(sizes) != count or any(n < 0 for n in sizes):
        raise ValueError(f"groups {sizes} do not add up to the {count} sequences given")
    out, at = [], 0
    for n in sizes:
        out.append(range(at, at + n))
        at += n
    return [r for r in out if len(r)]


_ENGINE = defaults("engine")  # config/schema.yaml describes every key and holds its default


@dataclass(frozen=True)
class EngineSettings:
    name: str = _ENGINE["name"]
    device: str = _ENGINE["device"]
    dtype: str = _ENGINE["dtype"]
    batch_size: int = _ENGINE["batch_size"]
    max_batch_tokens: int = _ENGINE["max_batch_tokens"]
    threads: int = _ENGINE["threads"]
    fast_path: str | bool = _ENGINE["fast_path"]
    # vLLM only
    tensor_parallel_size: int = _ENGINE["tensor_parallel_size"]
    max_model_len: int = _ENGINE["max_model_len"]
    gpu_memory_utilization: float = _ENGINE["gpu_memory_utilization"]
    enforce_eager: bool = _ENGINE["enforce_eager"]
    seed: int = _ENGINE["seed"]
    cpu_kvcache_gib: float = _ENGINE["cpu_kvcache_gib"]
    # Not config keys: set by the bench when it serves a draft
    draft: str | None = None  # an EAGLE-3 draft checkpoint: generate with speculative decoding (vLLM)
    num_speculative_tokens: int = 3
    # vLLM's num_speculative_tokens_per_batch_size: [[first batch size, last, k], ...]; None: k at every batch size
    schedule: list | None = None

    @classmethod
    def from_config(cls, engine: dict) -> "EngineSettings":
        return cls(**{k: engine[k] for k in cls.__dataclass_fields__ if k in engine})


class Engine:
    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        pass

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[Generation]:
        raise NotImplementedError

    def capture(self, sequences: list[list[int]], layer_ids: list[int]) -> list[Capture]:
        raise NotImplementedError

    def capture_rows(self, sequences: list[list[int]], layer_ids: list[int], groups: list[int] | None = None,
                     dtype: str = "bfloat16") -> Iterator[Rows]:
        """Rows of every sequence, batch by batch, in the shard dtype `dtype`. groups: sizes of consecutive groups of
        sequences that batches never mix (a stage's resume chunks); groups come out in order, each complete before
        the next begins. Every sequence is in exactly one Rows. This default calls capture() once per group and
        quantizes on the host (where capture() leaves the states)."""
        for group in group_ranges(len(sequences), groups):
            caps = self.capture([sequences[i] for i in group], layer_ids)
            aux, aux_scale = encode(torch.cat([c.aux for c in caps]), dtype)
            final, final_scale = encode(torch.cat([c.final for c in caps]), dtype)
            yield Rows(list(group), aux, final, aux_scale=aux_scale, final_scale=final_scale)

