"""Bad inputs across stages: each gives a message naming the file, row or key and what to do, and leaves no output
under a final name. The whole catalogue (these and the cases in other test files) is listed in tests/README.md.
"""

import json
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import save_file

from conftest import generate_mixed, snakemake, tiny_config
from eaglepipe import hidden_states, preflight, prompts, traces, vocab
from eaglepipe.config import ConfigError, load, validate
from eaglepipe.formats import TRACE_SCHEMA, read_hidden_shard, read_table, sha256_tree, write_table
from eaglepipe.target import fingerprint, read_info


# --- prompts ---------------------------------------------------------------------------------------------------

def run_prompts(tmp_path, lines, target, name="bad.jsonl"):
    source = tmp_path / name
    source.write_text("\n".join(lines) + "\n")
    out = {"train": tmp_path / "out/train.parquet", "eval": tmp_path / "out/eval.parquet"}
    try:
        prompts.run([str(source)], out, eval_fraction=0.5, max_prompts=None, max_prompt_tokens=256, too_long="error",
                    target_dir=target, system_prompt=None, template_kwargs={})
    finally:
        assert not any(p.exists() for p in out.values()), "a prompt split was written although the input is bad"
    return source


@pytest.mark.parametrize(
    "lines, message",
    [
        (['{"messages": [{"role": "narrator", "content": "Once"}]}'], r"row 1: turn 0 has unknown role 'narrator'"),
        (['{"prompt": "fine"}', "[1, 2]"], r"row 2: expected a JSON object, got list"),
        (['{"id": "a", "prompt": "one"}', '{"id": "a", "prompt": "two"}'],
         r"row 2: id 'a' is used by another record with different content"),
        (['{"messages": [{"role": "user", "content": ["not", "text"]}]}'], r"row 1: turn 0 content must be a string"),
    ],
    ids=["unknown-role", "not-an-object", "duplicate-id", "content-not-text"],
)
def test_bad_prompt_records(tmp_path, tiny_target, lines, message):
    with pytest.raises(prompts.PromptError, match=message) as err:
        run_prompts(tmp_path, lines, tiny_target)
    assert str(tmp_path / "bad.jsonl") in str(err.value)


def test_corrupt_parquet_prompt_file(tmp_path, tiny_target):
    with pytest.raises(prompts.PromptError, match=r"bad.parquet: not a readable Parquet file .* fix or replace it"):
        run_prompts(tmp_path, ["PAR1 this is not parquet"], tiny_target, name="bad.parquet")


@pytest.mark.parametrize("name, data, where", [
    ("bad.jsonl", b'{"prompt": "hello"}\n{"prompt": "caf\xe9 au lait"}\n', "row 2: byte 0xe9 at column 16"),
    ("bad.json", b'[\n{"prompt": "hello"},\n{"prompt": "caf\xe9"}\n]\n', "line 3: byte 0xe9 at column 16"),
], ids=["jsonl", "json-array"])
def test_prompt_file_that_is_not_utf8_is_named_at_parse_time(tmp_path, tiny_target, name, data, where):
    """One Latin-1 byte: the dry run (whose plan counts the prompts) names the file, row and column, and the fix."""
    (tmp_path / name).write_bytes(data)
    config = tiny_config(tiny_target, prompts={"sources": [str(tmp_path / name)]})
    result = snakemake(tmp_path / "run", config, "-n", check=False)
    assert result.returncode != 0
    assert f"{tmp_path / name}, {where} is not UTF-8; save the file as UTF-8" in result.stdout + result.stderr
    with pytest.raises(prompts.PromptError, match=rf"{name}, {where} is not UTF-8"):
        prompts.read_records(tmp_path / name)
    assert not (tmp_path / "run/results").exists()


def test_config_file_that_does_not_parse_names_file_and_line(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("train:\n  epochs: 2\n  lr: [0.1, 0.2\n  seed: 3\n")
    with pytest.raises(ConfigError, match=rf"{path}, line 4, column 7: not valid YAML \(expected ',' or "
                                          r"'\]', but got ':'\); fix it there"):
        load(path)


def test_missing_prompt_file_is_named_before_any_job(tmp_path, tiny_target):
    # A dry run plans without absent sources (the production config's data lives on the cluster); a real run stops.
    config = tiny_config(tiny_target, prompts={"sources": ["/no/such/prompts.jsonl"]})
    result = snakemake(tmp_path, config, check=False)
    assert result.returncode != 0
    assert "config key prompts.sources: '/no/such/prompts.jsonl' does not exist" in result.stdout + result.stderr
    assert not (tmp_path / "results").exists()


# --- target checkpoints ----------------------------------------------------------------------------------------

@pytest.fixture
def target_copy(tmp_path, tiny_target):
    copy = tmp_path / "target"
    shutil.copytree(tiny_target, copy)
    return copy


def edit_config(target, change):
    path = target / "config.json"
    config = json.loads(path.read_text())
    change(config)
    path.write_text(json.dumps(config))


def test_target_config_that_is_not_json(target_copy):
    (target_copy / "config.json").write_text('{"num_hidden_layers": 8,')
    with pytest.raises(ValueError, match=r"target/config.json: not valid JSON .* restore the checkpoint's config.json"):
        read_info(target_copy)


def test_target_config_without_depth(target_copy):
    edit_config(target_copy, lambda c: c.pop("num_hidden_layers"))
    with pytest.raises(ValueError, match=r"config.json: missing key 'num_hidden_layers'; is this a decoder-only"):
        read_info(target_copy)


def test_target_without_weights(target_copy):
    for path in target_copy.glob("*.safetensors"):
        path.unlink()
    with pytest.raises(FileNotFoundError, match=r"target checkpoint .*target: no \*.safetensors weights found"):
        preflight.check_target(target_copy)


def test_target_of_unknown_architecture(target_copy):
    edit_config(target_copy, lambda c: c.update(architectures=["NoSuchModelForCausalLM"]))
    with pytest.raises(preflight.PreflightError, match=r"config.json: architecture \['NoSuchModelForCausalLM'\] is not "
                                                       r"a causal language model known to the installed transformers"):
        preflight.check_target(target_copy)


def test_target_whose_tokenizer_exceeds_its_vocabulary(target_copy):
    edit_config(target_copy, lambda c: c.update(vocab_size=30000))
    with pytest.raises(preflight.PreflightError, match=r"tokenizer has 49152 tokens but config.json's vocab_size is "
                                                       r"30000: tokenizer and weights do not belong together"):
        preflight.check_target(target_copy)


# --- config against the target ---------------------------------------------------------------------------------

def test_layer_ids_not_increasing_fail_at_parse_time(tmp_path, tiny_target):
    config = tiny_config(tiny_target, hidden_states={"aux_layer_ids": [5, 2, 3]})
    result = snakemake(tmp_path, config, "-n", check=False)
    assert result.returncode != 0
    assert "config key hidden_states.aux_layer_ids: [5, 2, 3] must be 3 increasing ids in [0, 7]" in \
        result.stdout + result.stderr
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize(
    "override, message",
    [
        ({"hidden_states": {"max_length": 4096}},
         r"hidden_states.max_length: 4096 exceeds the target's max_position_embeddings \(2048\)"),
        ({"engine": {"name": "vllm", "max_model_len": 512}},
         r"engine.max_model_len: 512 is less than prompts.max_prompt_tokens \+ generation.max_new_tokens \(1036\)"),
    ],
    ids=["max-length-beyond-positions", "vllm-context-too-short"],
)
def test_config_that_does_not_fit_the_target(tiny_target, override, message):
    with pytest.raises(preflight.PreflightError, match=message):
        preflight.check_config(validate(tiny_config(tiny_target, **override)), read_info(tiny_target))


# --- trace shards ----------------------------------------------------------------------------------------------

def trace_row(i, output_ids, error=""):
    return {"id": f"p{i}", "split": "train", "messages": "[]", "prompt_ids": [1, 2], "output_ids": output_ids,
            "text": "", "loss_spans": [2, 2 + len(output_ids)], "finish_reason": "stop", "prompt_tokens": 2,
            "output_tokens": len(output_ids), "error": error}


def test_trace_shard_missing_columns(tmp_path):
    path = tmp_path / "shard-0.parquet"
    pq.write_table(pa.table({"id": ["p0"], "output_ids": [[1, 2]]}), path)
    with pytest.raises(ValueError, match=r"shard-0.parquet: missing columns \[.*'prompt_ids'.*\]; was it written by "
                                         r"another version\? Rebuild it and what was made from it with "
                                         r"`snakemake --cores all --forcerun "):
        read_table(path, TRACE_SCHEMA)


def test_trace_shard_that_is_not_parquet(tmp_path):
    path = tmp_path / "shard-0.parquet"
    path.write_bytes(b"\0" * 64)
    with pytest.raises(ValueError, match=r"shard-0.parquet: not a readable Parquet file .* rebuild it and what was "
                                         r"made from it with `snakemake --cores all --forcerun .*shard-0.parquet`"):
        read_table(path, TRACE_SCHEMA)


def test_trace_token_beyond_the_target_vocabulary(tmp_path):
    path = tmp_path / "shard-0.parquet"
    write_table(path, [trace_row(0, [5, 6]), trace_row(1, [7, 70000])], TRACE_SCHEMA)
    out = tmp_path / "vocab/vocab_map.safetensors"
    with pytest.raises(ValueError, match=r"shard-0.parquet: row p1 has token id 70000 >= target vocab 49152; traces "
                                         r"and target do not match, rerun the traces"):
        vocab.run([str(path)], out, tmp_path / "vocab/coverage.json", target_vocab=49152, draft_vocab_size=4,
                  curve_sizes=[2])
    assert not out.exists()


# --- hidden-state shards ---------------------------------------------------------------------------------------

def shard(tmp_path, change=None, layer_ids=(2, 4, 5), target="x"):
    t, h = 6, 8
    tensors = {"input_ids": torch.arange(t, dtype=torch.int32), "loss_mask": torch.ones(t, dtype=torch.uint8),
               "cu_seqlens": torch.tensor([0, t], dtype=torch.int64), "aux": torch.zeros(t, 3, h, dtype=torch.bfloat16),
               "final": torch.zeros(t, h, dtype=torch.bfloat16)}
    if change:
        change(tensors)
    path = tmp_path / f"shard-{len(list(tmp_path.glob('shard-*.safetensors')))}.safetensors"
    meta = {"ids": ["p0"], "layer_ids": list(layer_ids), "layer_convention": "input_of_layer",
            "target_fingerprint": target}
    save_file(tensors, str(path), metadata={"eaglepipe": json.dumps(meta, sort_keys=True)})
    return path


def test_hidden_shard_missing_a_tensor(tmp_path):
    path = shard(tmp_path, lambda t: t.pop("final"))
    with pytest.raises(ValueError, match=r"hidden-state shard .*shard-0.safetensors: missing tensors \['final'\]"):
        read_hidden_shard(path)


def test_hidden_shard_with_wrong_dtype(tmp_path):
    path = shard(tmp_path, lambda t: t.update(aux=t["aux"].float()))
    with pytest.raises(ValueError, match=r"shard-0.safetensors: aux has dtype torch.float32, expected torch.bfloat16"):
        read_hidden_shard(path)


def record(path):
    """The record the shard's hidden_states job would have written beside it."""
    tensors, meta = read_hidden_shard(path)
    hidden_states.write_record(path.with_suffix(".json"), path, digest=sha256_tree(path), tensors=tensors,
                               metadata=meta)
    return path.with_suffix(".json")


def test_hidden_shards_with_different_layer_ids(tmp_path, tiny_target):
    target = fingerprint(tiny_target)
    paths = [shard(tmp_path, target=target), shard(tmp_path, layer_ids=(1, 4, 5), target=target)]
    records = [record(p) for p in paths]
    out = tmp_path / "manifest.json"
    with pytest.raises(ValueError, match=r"shard-1.safetensors: layer ids \[1, 4, 5\] differ from other shards' "
                                         r"\[2, 4, 5\]"):
        hidden_states.manifest({"train": [str(p) for p in paths]}, {"train": [str(r) for r in records]}, out,
                               target_dir=tiny_target, engine="transformers")
    assert not out.exists()


def test_shard_record_of_another_shard(tmp_path, tiny_target):
    paths = [shard(tmp_path), shard(tmp_path)]
    records = [record(p) for p in paths]
    out = tmp_path / "manifest.json"
    with pytest.raises(ValueError, match=r"shard-1.json: records shard 'shard-1.safetensors', not "
                                         r"'shard-0.safetensors'; re-extract it with `snakemake --cores all "
                                         r"--forcerun .*shard-0.safetensors`"):
        hidden_states.manifest({"train": [str(p) for p in paths]}, {"train": [str(r) for r in records[::-1]]}, out,
                               target_dir=tiny_target, engine="transformers")
    assert not out.exists()


def test_shard_record_from_before_sha256_tree(tmp_path, tiny_target):
    """A results folder from an eaglepipe that recorded a plain sha256: the manifest names the record to delete."""
    path = shard(tmp_path)
    rec = record(path)
    old = json.loads(rec.read_text())
    old["sha256"] = old.pop("sha256_tree")
    rec.write_text(json.dumps(old))
    out = tmp_path / "manifest.json"
    with pytest.raises(ValueError, match=r"shard-0.json: no sha256_tree .*; re-extract it with `snakemake --cores "
                                         r"all --forcerun .*shard-0.safetensors`"):
        hidden_states.manifest({"train": [str(path)]}, {"train": [str(rec)]}, out, target_dir=tiny_target,
                               engine="transformers")
    assert not out.exists()


def test_shard_record_of_another_target(tmp_path, tiny_target):
    """A shard extracted from other weights (its record names another target fingerprint) is not gathered."""
    path = shard(tmp_path)
    rec = record(path)
    other = json.loads(rec.read_text())
    other["target_fingerprint"] = "0123456789abcdef"
    rec.write_text(json.dumps(other))
    out = tmp_path / "manifest.json"
    with pytest.raises(ValueError, match=r"shard-0.json: target_fingerprint '0123456789abcdef' is not the target's "
                                         r"'[0-9a-f]{16}' .*: the shard was extracted from other weights; re-extract "
                                         r"it with `snakemake --cores all --forcerun .*shard-0.safetensors`"):
        hidden_states.manifest({"train": [str(path)]}, {"train": [str(rec)]}, out, target_dir=tiny_target,
                               engine="transformers")
    assert not out.exists()


# --- failed requests in generation ------------------------------------------------------------------------------

def generate(tmp_path, target, max_error_share):
    return generate_mixed(tmp_path, target, max_error_share=max_error_share, chunk_size=8, max_new_tokens=4)


def test_error_share_above_the_threshold_fails_the_shard(tmp_path, small_vocab_target):
    with pytest.raises(RuntimeError, match=r"traces train/shard-0: 3 of 5 requests failed, more than "
                                           r"generation.max_error_share=0.5; see the warnings above for reasons"):
        generate(tmp_path, small_vocab_target, 0.5)
    assert not (tmp_path / "traces/shard-0.parquet").exists()


def test_failed_requests_within_the_threshold_are_recorded_with_id_and_reason(tmp_path, small_vocab_target):
    out = generate(tmp_path, small_vocab_target, 0.6)
    failed = {r["id"]: r for r in read_table(out) if r["error"]}
    assert sorted(failed) == ["q2", "q3", "q4"]
    assert all(r["error"].startswith("rejected: prompt token id ") and "outside the target's vocabulary of 30000"
               in r["error"] and r["finish_reason"] == "error" and r["output_ids"] == [] for r in failed.values())
    traces.stats([str(out)], tmp_path / "stats.json")
    assert json.loads((tmp_path / "stats.json").read_text())["train"]["errors"] == 3
