"""Bytes per token of a finished workflow's hidden-state shards, for the record:

    python -m eaglepipe.tools.shard_bytes --directory RUN [--json out.json]

Reads RUN/results/hidden_states/manifest.json and the shards' sizes on disk. bytes_per_token is their bytes over
their tokens (headers and cu_seqlens included), also under bytes_per_token_bf16 or bytes_per_token_fp8 after the
shards' dtype; formula_bytes_per_token is formats.bytes_per_token, what the estimates use.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..formats import bytes_per_token, common_dtype

MANIFEST = "results/hidden_states/manifest.json"
SHORT = {"bfloat16": "bf16", "float8_e4m3fn": "fp8"}


def measure(directory) -> dict:
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.is_file():
        raise SystemExit(f"{path}: missing; give the folder of a workflow run whose manifest rule has run")
    manifest = json.loads(path.read_text())
    paths = [directory / s["path"] for s in manifest["shards"]]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise SystemExit(f"{path} lists shards that are not there: {', '.join(missing)}")
    dtype = common_dtype(paths)
    tokens = sum(s["tokens"] for s in manifest["shards"])
    size = sum(p.stat().st_size for p in paths)
    per = size / max(tokens, 1)
    return {"directory": str(directory), "dtype": dtype, "shards": len(paths), "tokens": tokens, "bytes": size,
            "bytes_per_token": per, f"bytes_per_token_{SHORT[dtype]}": per,
            "formula_bytes_per_token": bytes_per_token(dtype, len(manifest["layer_ids"]), manifest["hidden_size"])}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--directory", default=".", help="the workflow's directory (snakemake -d)")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args(argv)
    result = measure(args.directory)
    text = json.dumps(result, indent=2, sort_keys=True)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
