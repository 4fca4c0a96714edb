"""A KV connector for vLLM's `extract_hidden_states` method that runs on CPU and CUDA alike and writes one spool
per engine instead of one file per request.

vLLM loads this module by path (`kv_connector_module_path`) in its engine and worker processes. The captured
states of a finished request ([tokens, n_layers, hidden], model dtype) are read from the hidden-state cache group,
moved to host memory synchronously (no CUDA streams, events or pinned memory, which is what breaks vLLM's example
connector on CPU) and appended to the spool:
    <spool_dir>/spool.bin     raw bytes of each request's tensor, back to back
    <spool_dir>/spool.jsonl   one line per request: {"req_id", "offset", "shape", "dtype"}, written after its bytes
The engine (eaglepipe/engines/vllm.py) reads the rows it needs by offset and deletes the spool when it closes.
"""

from __future__ import annotations

import json
import os

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    ExampleHiddenStatesConnectorMetadata,
    extract_from_kv_cache,
)

SPOOL_DATA, SPOOL_INDEX = "spool.bin", "spool.jsonl"


class SpoolHiddenStatesConnector(ExampleHiddenStatesConnector):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._written: set[str] = set()

    def wait_for_save(self) -> None:
        pass  # no per-request lock files: the index line is the completion signal

    def _submit_async_write(self, pending) -> None:
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (blocks[:, None] * self._block_size + torch.arange(self._block_size)[None, :]).flatten()
        states = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device), len(pending.token_ids))
        states = states.to("cpu").contiguous()
        os.makedirs(self._storage_path, exist_ok=True)
        with open(os.path.join(self._storage_path, SPOOL_DATA), "ab") as f:
            offset = f.tell()
            f.write(states.view(torch.uint8).numpy().tobytes())
        line = {"req_id": pending.req_id, "offset": offset, "shape": list(states.shape),
                "dtype": str(states.dtype).removeprefix("torch.")}
        with open(os.path.join(self._storage_path, SPOOL_INDEX), "a") as f:
            f.write(json.dumps(line) + "\n")
        self._written.add(pending.req_id)

    def get_finished(self, finished_req_ids):
        if not self._is_tp_rank_zero:
            return None, None  # only rank 0 writes and reports (get_finished_count() == 1)
        if self.has_connector_metadata():
            metadata = self._get_connector_metadata()
            if isinstance(metadata, ExampleHiddenStatesConnectorMetadata):
                for pending in metadata.pending_saves:
                    self._submit_async_write(pending)
        self._accumulated_finished_req_ids.update(finished_req_ids)
        done = self._accumulated_finished_req_ids & self._written
        self._accumulated_finished_req_ids -= done
        self._written -= done
        return done or None, None
