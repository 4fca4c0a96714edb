"""The engine interface: the one door through which the pipeline runs a target model.

An engine is a context manager (start on enter; processes and memory released on exit, success or failure) with:
    generate(prompts, sampling) -> one Generation per prompt (failures reported per item, never raised for all)
    capture(sequences, layer_ids) -> one Capture per sequence, ids in "input of layer k" numbering
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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


@dataclass
class Capture:
    aux: torch.Tensor  # [T, n_aux, H] bf16: input of each requested layer
    final: torch.Tensor  # [T, H] bf16: the final hidden state after the target's final norm


@dataclass(frozen=True)
class EngineSettings:
    name: str = "transformers"
    device: str = "cpu"
    dtype: str = "float32"
    batch_size: int = 16
    max_batch_tokens: int = 8192
    threads: int = 1
    fast_path: str | bool = "auto"  # transformers only: engines/fast.py (auto: on CUDA, for the layouts it runs)
    # vLLM only
    tensor_parallel_size: int = 1
    max_model_len: int = 4096
    gpu_memory_utilization: float = 0.85
    enforce_eager: bool = True
    seed: int = 0
    cpu_kvcache_gib: float = 2.0
    draft: str | None = None  # an EAGLE-3 draft checkpoint: generate with speculative decoding (vLLM)
    num_speculative_tokens: int = 3

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

