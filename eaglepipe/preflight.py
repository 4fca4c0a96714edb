"""Preflight: checks at the start of an engine job, before the target loads, that the job can finish.

Busy GPUs (memory held by other processes), free disk against the estimated bytes of the stage's outputs, the
target loadable, the config consistent with the target. Each failure names what is wrong and what to do, within
seconds of the job's start instead of hours into it. The config checks also run when Snakemake parses the workflow
(rules/common.smk) for a user's checkpoint, before any job starts.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from . import reasoning
from .config import SCHEMA, ConfigError, validate, variant_settings
from .formats import bytes_per_token
from .target import TargetInfo, _safetensors_files, read_info, resolve_layer_ids
from . import estimate

log = logging.getLogger(__name__)

GIB = 1 << 30
TRACE_BYTES_PER_TOKEN = 12  # prompt and output ids (int32) plus decoded text, before compression: an upper guess


class PreflightError(RuntimeError):
    pass


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    name: str
    used_mib: int | None  # None where nvidia-smi reports [N/A]
    gpu_uuid: str


def parse_compute_apps(text: str) -> list[GpuProcess]:
    """Rows of `nvidia-smi --query-compute-apps=pid,process_name,used_memory,gpu_uuid --format=csv,noheader`."""
    procs = []
    for line in text.splitlines():
        if not line.strip() or line.startswith("No running"):
            continue
        # A process name may hold commas: pid comes first, memory and uuid last.
        pid, _, rest = line.partition(",")
        fields = [f.strip() for f in rest.rsplit(",", 2)]
        if len(fields) < 3 or not pid.strip().isdigit():
            raise ValueError(f"unexpected nvidia-smi compute-apps line: {line!r}")
        memory = fields[1].split()[0] if fields[1] else ""
        procs.append(GpuProcess(int(pid), fields[0], int(memory) if memory.isdigit() else None, fields[2]))
    return procs


def parse_gpu_uuids(text: str) -> dict[str, str]:
    """GPU index -> uuid from `nvidia-smi --query-gpu=index,uuid --format=csv,noheader`."""
    out = {}
    for line in text.splitlines():
        if line.strip():
            index, uuid = (f.strip() for f in line.split(",", 1))
            out[index] = uuid
    return out


def busy_gpu_problems(apps_text: str, gpus_text: str, visible: str | None, own_pid: int) -> list[str]:
    """Other processes holding memory on the job's GPUs (`visible`: CUDA_VISIBLE_DEVICES, indices or uuids;
    None: every GPU), one line each."""
    uuids = parse_gpu_uuids(gpus_text)
    if visible is None:
        mine = set(uuids.values())
    else:
        mine = {v if v.startswith(("GPU-", "MIG-")) else uuids.get(v, v)
                for v in (x.strip() for x in visible.split(",")) if v}
    index_of = {uuid: index for index, uuid in uuids.items()}
    problems = []
    for p in parse_compute_apps(apps_text):
        if p.gpu_uuid in mine and p.pid != own_pid:
            memory = "unknown memory" if p.used_mib is None else f"{p.used_mib} MiB"
            problems.append(f"GPU {index_of.get(p.gpu_uuid, p.gpu_uuid)}: pid {p.pid} ({p.name}) holds {memory}")
    return problems


def check_gpus(gpus: int, *, allow_busy: bool, apps_text: str | None = None, gpus_text: str | None = None,
               visible: str | None = None, own_pid: int | None = None) -> None:
    """Fail when the job's GPUs hold memory of other processes. The nvidia-smi texts default to a live query."""
    if gpus <= 0:
        return
    if apps_text is None:
        if shutil.which("nvidia-smi") is None:
            log.info("preflight: nvidia-smi not found, GPU occupancy not checked")
            return
        apps_text = _nvidia_smi("--query-compute-apps=pid,process_name,used_memory,gpu_uuid")
        gpus_text = _nvidia_smi("--query-gpu=index,uuid")
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    problems = busy_gpu_problems(apps_text, gpus_text or "", visible, os.getpid() if own_pid is None else own_pid)
    if not problems:
        log.info("preflight: GPUs %s free of other processes", visible or "(all)")
        return
    message = ("the GPUs given to this job hold memory of other processes:\n  " + "\n  ".join(problems) +
               "\nStop those processes (e.g. a forgotten vLLM server: kill <pid>), or set config key "
               "preflight.allow_busy_gpus: true to start anyway")
    if allow_busy:
        log.warning("preflight: %s", message)
        return
    raise PreflightError(message)


def _nvidia_smi(query: str) -> str:
    result = subprocess.run(["nvidia-smi", query, "--format=csv,noheader,nounits"], capture_output=True, text=True,
                            check=False, timeout=60)
    if result.returncode != 0:
        raise PreflightError(f"nvidia-smi {query} failed ({result.returncode}): {result.stderr.strip()}; check the "
                             "GPU driver, or set preflight.enabled: false to skip the checks")
    return result.stdout


def check_disk(folder, needed_bytes: int, *, reserve_bytes: int = 0, free_bytes: int | None = None,
               what: str = "outputs") -> None:
    """Fail when the disk of `folder` has less than needed_bytes + reserve_bytes free."""
    folder = Path(folder)
    probe = next(p for p in [folder, *folder.parents] if p.exists())
    free = shutil.disk_usage(probe).free if free_bytes is None else free_bytes
    if free - reserve_bytes < needed_bytes:
        raise PreflightError(
            f"not enough disk for {what} in {folder}: about {needed_bytes / GIB:.2f} GiB needed "
            f"({needed_bytes} bytes), {free / GIB:.2f} GiB free ({free} bytes)"
            + (f" of which preflight.reserve_disk_gib keeps {reserve_bytes / GIB:.2f} GiB" if reserve_bytes else "")
            + "; free space there, or point the workflow's directory (snakemake -d) at a larger disk")
    log.info("preflight: %s need about %.2f GiB in %s, %.2f GiB free", what, needed_bytes / GIB, folder, free / GIB)


def hidden_state_bytes(tokens: int, num_aux: int, hidden_size: int, dtype: str = "bfloat16") -> int:
    """Bytes of a hidden-state shard of `tokens` tokens, its states in `dtype` (formats.bytes_per_token)."""
    return tokens * bytes_per_token(dtype, num_aux, hidden_size)


def trace_bytes(prompts: int, prompt_tokens: int, max_new_tokens: int) -> int:
    return prompts * (prompt_tokens + max_new_tokens) * TRACE_BYTES_PER_TOKEN


def traces_estimate(prompts_path, shard: int, num_shards: int, max_new_tokens: int) -> int:
    """Bytes of one trace shard: its prompts (about 4 characters per token) and their longest responses."""
    from .formats import PROMPT_SCHEMA, read_table
    from .traces import shard_of

    rows = [r for r in read_table(prompts_path, PROMPT_SCHEMA) if shard_of(r["id"], num_shards) == shard]
    return trace_bytes(len(rows), sum(len(r["messages"]) for r in rows) // 4 // max(len(rows), 1), max_new_tokens)


def hidden_states_estimate(trace_path, max_length: int, hidden_size: int, num_aux: int = 3,
                           dtype: str = "bfloat16") -> int:
    """Bytes of one hidden-state shard, from the tokens of its trace shard."""
    from .formats import TRACE_SCHEMA, read_table
    from .hidden_states import sequences_of

    _, seqs, _ = sequences_of(read_table(trace_path, TRACE_SCHEMA), max_length)
    return hidden_state_bytes(sum(map(len, seqs)), num_aux, hidden_size, dtype)


def stage_bytes(job_bytes: int, stage_outputs: list[str], resume_copy: bool = True) -> int:
    """The job's own outputs, its resume units when they hold a copy of the data (traces; hidden states resume from
    their partial shard instead), and the stage's other outputs not yet written, estimated at this job's size: a disk
    that cannot hold the stage fails the first job, not the last."""
    missing = sum(not Path(p).exists() for p in stage_outputs) if stage_outputs else 1
    return job_bytes * (max(missing, 1) + int(resume_copy))


def check_target(target_dir) -> TargetInfo:
    """The target's config.json readable, its architecture known to transformers, weights present."""
    info = read_info(target_dir)
    config = json.loads((Path(target_dir) / "config.json").read_text())
    archs = config.get("architectures") or []
    if not config.get("auto_map"):  # remote-code models bring their own classes
        from transformers.models.auto import modeling_auto as auto

        known = {name for mapping in (auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                      auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES) for name in mapping.values()}
        unknown = [a for a in archs if a not in known]
        if not archs or unknown:
            raise PreflightError(f"{Path(target_dir) / 'config.json'}: architecture {archs or '(none listed)'} is not "
                                 "a causal language model known to the installed transformers; check the checkpoint "
                                 "or upgrade transformers")
    _safetensors_files(Path(target_dir))
    from .chat import load_tokenizer

    tokens = len(load_tokenizer(target_dir))
    if tokens > info.vocab_size:
        raise PreflightError(f"{target_dir}: its tokenizer has {tokens} tokens but config.json's vocab_size is "
                             f"{info.vocab_size}: tokenizer and weights do not belong together; fix the checkpoint")
    return info


def check_config(config: dict, info: TargetInfo) -> None:
    """Settings that must agree with the target: layer ids within its depth, vocabularies, lengths."""
    problems = []
    try:
        resolve_layer_ids(config["hidden_states"]["aux_layer_ids"], info)
    except ValueError as err:
        problems.append(str(err))
    draft_vocab = config["vocab"]["draft_vocab_size"]
    if draft_vocab > info.vocab_size:
        problems.append(f"config key vocab.draft_vocab_size: {draft_vocab} is larger than the target's vocabulary "
                        f"({info.vocab_size}); lower it")
    max_length = config["hidden_states"]["max_length"]
    if max_length > info.max_position_embeddings:
        problems.append(f"config key hidden_states.max_length: {max_length} exceeds the target's "
                        f"max_position_embeddings ({info.max_position_embeddings}); lower it")
    engine = config["engine"]
    needed = config["prompts"]["max_prompt_tokens"] + config["generation"]["max_new_tokens"]
    if engine["name"] == "vllm" and engine["max_model_len"] < needed:
        problems.append(f"config key engine.max_model_len: {engine['max_model_len']} is less than "
                        f"prompts.max_prompt_tokens + generation.max_new_tokens ({needed}); raise it or lower those")
    if problems:
        raise PreflightError("configuration does not fit the target:\n  " + "\n  ".join(problems))


def run_job(config: dict, target_dir, *, output_path, needed_bytes: int, stage_outputs: list[str], what: str,
            gpus: int, resume_copy: bool = True) -> None:
    """Every check for one engine job, in order of cost; raises PreflightError on the first failing one."""
    settings = config["preflight"]
    if not settings["enabled"]:
        log.info("preflight: disabled by config key preflight.enabled")
        return
    info = check_target(target_dir)
    check_config(config, info)
    check_gpus(gpus, allow_busy=settings["allow_busy_gpus"])
    check_disk(Path(output_path).parent, stage_bytes(needed_bytes, stage_outputs, resume_copy),
               reserve_bytes=int(settings["reserve_disk_gib"] * GIB), what=what)


def check_workflow(config: dict, schema_path=SCHEMA, *, embedded_target: str) -> dict:
    """Every check the workflow makes on its configuration when it parses, in one place, before any job: the schema
    (defaults filled in); once the target's config.json is there, the settings that must fit the target
    (check_config; jobs check again); the chat template file; the system-prompt policy; the target's
    facts and the aux layer ids. Raises ConfigError naming the key; returns the target's facts (estimate.py)."""
    validate(config, schema_path)
    variant_settings(config, schema_path)
    path = config["target"]["path"] or embedded_target
    if config["preflight"]["enabled"] and Path(path, "config.json").is_file():
        try:
            check_config(config, read_info(path))
        except (ValueError, PreflightError) as err:
            raise ConfigError(f"{err}\n(target {path})") from None
    try:
        if config["target"]["chat_template"] is not None:
            reasoning.read_template(config["target"]["chat_template"])
        reasoning.apply_system_policy([], config["prompts"]["system_policy"], config["prompts"]["system_prompt"])
        facts = estimate.target_facts(config, embedded_target)
        resolve_layer_ids(config["hidden_states"]["aux_layer_ids"], TargetInfo(facts["num_layers"], 0, 0, 0, {}))
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return facts
