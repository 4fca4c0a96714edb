"""fp8 hidden-state shards (hidden_states.dtype float8_e4m3fn): the quantizer's round trip on real SmolLM2 states
against its stated bound, the device-side quantization equal to quantizing the bf16 shard, damage caught by
validation, the whole workflow trained on fp8 shards at half the bytes per token, and mixed dtypes refused."""

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import snakemake, tiny_config

from eaglepipe import hidden_states, train, validate
from eaglepipe.chat import load_tokenizer
from eaglepipe.config import validate as validate_config
from eaglepipe.engines import open_engine
from eaglepipe.engines.base import EngineSettings
from eaglepipe.formats import (
    bytes_per_token,
    common_dtype,
    dequantize,
    encode,
    quantize,
    read_hidden_shard,
    sha256_tree,
    shard_dtype,
    write_hidden_shard,
)
from eaglepipe.hidden_states import extract, shard_tensors
from eaglepipe.tools import shard_bytes

FP8 = "float8_e4m3fn"
TEXTS = ["The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b\n",
         "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen in the chloroplasts of plants."]


def test_quantizer_round_trip_on_smollm2_states_is_within_the_e4m3_bound(smollm2):
    tokenizer = load_tokenizer(smollm2)
    seqs = [[1] + tokenizer.encode(t) for t in TEXTS]  # a first token as the chat template starts: its rows are large
    with open_engine(smollm2, EngineSettings(threads=2)) as eng:
        caps = eng.capture(seqs, [2, 15, 27])
    for name, x in (("aux", torch.cat([c.aux for c in caps])), ("final", torch.cat([c.final for c in caps]))):
        x = x.float()
        values, scale = quantize(x)
        assert values.dtype == torch.float8_e4m3fn and scale.shape == x.shape[:-1]
        y = dequantize(values, scale, torch.float32)
        # the stated bound (formats.py): half a step of the 3-bit mantissa, half the subnormal step near zero
        bound = 2 ** -4 * x.abs() + 2 ** -10 * scale.unsqueeze(-1)
        assert bool(((y - x).abs() <= bound * (1 + 1e-5)).all()), name
        row_error = (y - x).norm(dim=-1) / x.norm(dim=-1)
        assert float(row_error.max()) < 2 ** -4 and float(row_error.median()) < 0.03, name
        # one scale for all the rows (what per-row scales are for) loses more on the worst row
        shared = x.abs().max() / 448
        z = (x / shared).clamp(-448, 448).to(torch.float8_e4m3fn).float() * shared
        assert float(((z - x).norm(dim=-1) / x.norm(dim=-1)).max()) > float(row_error.max()), name
    values, scale = quantize(torch.zeros(2, 8))  # a row of zeros stays zeros, with a finite scale
    assert float(scale.min()) == 1.0 and not dequantize(values, scale, torch.float32).any()


@pytest.mark.parametrize("fast", [True, False])
def test_fp8_shard_streamed_from_the_engine_is_the_quantized_bf16_shard(tmp_path, tiny_target, fast):
    """The fast path quantizes on the capture device, the reference engine on the host: both write exactly the
    bytes of write_hidden_shard over encode() of the bf16 states."""
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(3, 49000, (n,), generator=gen).tolist() for n in (7, 19, 4, 25, 11)]
    masks = [[1] * len(s) for s in seqs]
    layers = [1, 4, 5]
    metadata = {"ids": [f"s{i}" for i in range(len(seqs))], "layer_ids": layers, "target_fingerprint": "tiny"}
    small = shard_tensors(seqs, masks)
    with open_engine(tiny_target, EngineSettings(batch_size=2, max_batch_tokens=32, fast_path=fast)) as eng:
        assert (eng.fast is not None) == fast
        digest = extract(eng, tmp_path / "fp8.safetensors", seqs, small, metadata, layers, hidden=128, chunk_size=2,
                         dtype=FP8)
        caps = eng.capture(seqs, layers)
    aux, aux_scale = encode(torch.cat([c.aux for c in caps]), FP8)
    final, final_scale = encode(torch.cat([c.final for c in caps]), FP8)
    write_hidden_shard(tmp_path / "ref.safetensors", {**small, "aux": aux, "final": final, "aux_scale": aux_scale,
                                                      "final_scale": final_scale}, metadata)
    assert (tmp_path / "fp8.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    assert digest == sha256_tree(tmp_path / "fp8.safetensors") and shard_dtype(tmp_path / "fp8.safetensors") == FP8


@pytest.fixture(scope="module")
def fp8_run(tmp_path_factory, tiny_target):
    """The workflow on the tiny target with fp8 shards, through training and offline evaluation."""
    workdir = tmp_path_factory.mktemp("fp8")
    config = tiny_config(tiny_target, hidden_states={"max_length": 128, "dtype": FP8})
    snakemake(workdir, config, "results/eval/acceptance.json")
    return workdir, config


def test_training_on_fp8_shards_runs_end_to_end_at_half_the_bytes_per_token(fp8_run, tmp_path, tiny_target):
    workdir, config = fp8_run
    manifest = json.loads((workdir / "results/hidden_states/manifest.json").read_text())
    assert manifest["dtype"] == FP8 and all(
        json.loads((workdir / s["path"]).with_suffix(".json").read_text())["dtype"] == FP8 for s in manifest["shards"])
    tensors, _ = read_hidden_shard(workdir / manifest["shards"][0]["path"])
    assert tensors["aux"].dtype == torch.float8_e4m3fn and tensors["aux_scale"].shape == tensors["aux"].shape[:2]
    assert json.loads((workdir / "results/hidden_states/validation.json").read_text())["shards"]
    acceptance = json.loads((workdir / "results/eval/acceptance.json").read_text())
    assert acceptance["positions"] > 0 and set(acceptance["tau"]) == {"1", "2", "3"}
    log = [json.loads(line) for line in (workdir / "results/draft/train_log.jsonl").read_text().splitlines()]
    assert log and all(math.isfinite(x) for x in log[-1]["loss"])  # the dequantized states trained the draft
    assert "float8_e4m3fn hidden states" in (workdir / "logs/train.log").read_text()

    # The same trace shard extracted in bf16 by the stage's own code: fp8's states take exactly half the bytes, plus
    # the scales' 4 bytes per layer row (3 aux + final); the rest of the file (header, cu_seqlens, the id and mask
    # of each token) is what the estimate's formula leaves aside or counts alike.
    entry = next(s for s in manifest["shards"] if s["split"] == "train")
    fp8 = workdir / entry["path"]
    bf16 = tmp_path / "bf16.safetensors"
    hidden_states.run(workdir / "results/traces/train" / f"{fp8.stem}.parquet", bf16, target_dir=tiny_target,
                      layer_ids=None, engine={"name": "transformers"}, max_length=128, chunk_size=8)
    tokens, sequences = entry["tokens"], entry["samples"]
    assert json.loads(bf16.with_suffix(".json").read_text())["tokens"] == tokens

    def states_bytes(path, dtype):
        with open(path, "rb") as f:
            header = 8 + int.from_bytes(f.read(8), "little")
        rest = path.stat().st_size - header - 8 * (sequences + 1)
        assert rest == tokens * bytes_per_token(dtype, 3, 128)  # the estimates' formula is what a shard holds
        return rest - tokens * (4 + 1)

    assert states_bytes(fp8, FP8) == states_bytes(bf16, "bfloat16") // 2 + tokens * 4 * 4
    per_bf16, per_fp8 = bf16.stat().st_size / tokens, fp8.stat().st_size / tokens
    assert per_bf16 / 2 < per_fp8 < per_bf16 / 2 + 4 * 4 + 2.5 + 2  # scales, half the id and mask, the header

    # the record tool: bytes per token of the finished run, with the formula beside it
    result = shard_bytes.main(["--directory", str(workdir), "--json", str(tmp_path / "bytes.json")])
    assert result["dtype"] == FP8 and result["bytes_per_token_fp8"] == result["bytes_per_token"]
    assert result["tokens"] == sum(manifest["tokens"].values())
    assert result["bytes"] == sum((workdir / s["path"]).stat().st_size for s in manifest["shards"])
    assert result["formula_bytes_per_token"] == bytes_per_token(FP8, 3, 128) < result["bytes_per_token"]
    assert json.loads((tmp_path / "bytes.json").read_text()) == result

    # A run given fp8 shards and a bf16 one is refused, naming the bf16 shard: training, the manifest, the tool.
    others = [workdir / s["path"] for s in manifest["shards"] if s["split"] == "train" and s is not entry]
    with pytest.raises(ValueError, match=f"hidden-state shard {bf16} holds bfloat16 states but .* holds {FP8}"):
        common_dtype([*others, bf16])
    settings = validate_config(json.loads(json.dumps(config)))["train"]
    with pytest.raises(ValueError) as refused:
        train.run([*map(str, others), str(bf16)], workdir / "results/vocab/vocab_map.safetensors", tmp_path / "draft",
                  target_dir=tiny_target, layer_ids=manifest["layer_ids"], settings=settings, threads=1)
    assert str(bf16) in str(refused.value) and str(others[0]) in str(refused.value)  # named, in whichever order
    assert "one run takes shards of one hidden_states.dtype" in str(refused.value)
    assert not (tmp_path / "draft").exists()
    records = [str(p.with_suffix(".json")) for p in others]
    with pytest.raises(ValueError, match=f"{bf16}: holds bfloat16 states but the shards before it hold {FP8}"):
        hidden_states.manifest({"train": [*map(str, others), str(bf16)]},
                               {"train": [*records, str(bf16.with_suffix(".json"))]}, tmp_path / "manifest.json",
                               target_dir=tiny_target, engine="transformers")
    assert not (tmp_path / "manifest.json").exists()


def test_a_flipped_byte_in_an_fp8_shard_fails_validation(fp8_run, tmp_path):
    workdir, _ = fp8_run
    manifest = json.loads((workdir / "results/hidden_states/manifest.json").read_text())
    entry = next(s for s in manifest["shards"] if s["split"] == "train")
    shard = tmp_path / "shard-0.safetensors"
    data = bytearray((workdir / entry["path"]).read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit of one fp8 value in the aux region
    shard.write_bytes(bytes(data))
    trace = workdir / "results/traces/train" / f"{Path(entry['path']).stem}.parquet"
    man = {**manifest, "shards": [{**entry, "path": str(shard)}]}
    with pytest.raises(validate.ShardError, match=r"shard-0.safetensors: sha256_tree .* differs"):
        validate.check_shard(man["shards"][0], man, trace, max_length=128)
    validate.check_shard({**entry, "path": str(workdir / entry["path"])}, manifest, trace, max_length=128)  # intact


def test_validation_finds_nan_in_fp8_values_and_scales(tmp_path):
    """e4m3fn has no Inf: its NaN codes (0x7F, 0xFF) and non-finite scales are what validation must find."""
    small = shard_tensors([[5, 6, 7, 8]], [[0, 1, 1, 1]])
    aux, aux_scale = encode(torch.randn(4, 3, 16), FP8)
    final, final_scale = encode(torch.randn(4, 16), FP8)
    tensors = {**small, "aux": aux, "final": final, "aux_scale": aux_scale, "final_scale": final_scale}
    path = tmp_path / "s.safetensors"
    write_hidden_shard(path, tensors, {"ids": ["a"]})
    validate.check_finite(path, "s")
    bad = aux.clone()
    bad.view(torch.uint8)[2, 1, 3] = 0xFF
    write_hidden_shard(path, {**tensors, "aux": bad}, {"ids": ["a"]})
    with pytest.raises(validate.ShardError, match="1 NaN/Inf values in 'aux', first at token 2"):
        validate.check_finite(path, "s")
    scale = final_scale.clone()
    scale[3] = float("inf")
    write_hidden_shard(path, {**tensors, "final_scale": scale}, {"ids": ["a"]})
    with pytest.raises(validate.ShardError, match="1 NaN/Inf values in 'final_scale', first at token 3"):
        validate.check_finite(path, "s")
