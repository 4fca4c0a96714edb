"""The key tables of config/README.md, generated from config/schema.yaml (the one description of every key).

    python -m eaglepipe.tools.config_docs            # rewrite the tables in config/README.md
    python -m eaglepipe.tools.config_docs --check    # exit 1 when they are stale (CI and tests/test_layout.py)

A table sits between `<!-- keys: SECTION -->` and `<!-- end keys -->` and lists the direct keys of SECTION (e.g.
`prompts` or `prompts.synthesize`); a key with a table of its own is left out of its parent's. The default column is
the schema's default, with config/config.yaml's value beside it where that file sets another.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import yaml

from ..config import SCHEMA

README = SCHEMA.parent / "README.md"
SHIPPED = SCHEMA.parent / "config.yaml"
TABLE = re.compile(r"(<!-- keys: ([\w.]+) -->\n)(.*?)(<!-- end keys -->)", re.S)


def _properties(schema: dict, path: str) -> dict:
    node = schema
    for part in path.split("."):
        node = node["properties"][part]
    return node["properties"]


def _lookup(config: dict, path: str):
    node = config
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return None, False
        node = node[part]
    return node, True


def _value(v) -> str:
    return f"`{v if isinstance(v, str) else json.dumps(v)}`".replace("|", "\\|")


def table(schema: dict, shipped: dict, path: str, own_tables: set[str]) -> str:
    """The markdown table of the direct keys of `path`."""
    lines = ["| key | default | meaning |", "|---|---|---|"]
    for key, spec in _properties(schema, path).items():
        full = f"{path}.{key}"
        if full in own_tables:
            continue
        default = _value(spec.get("default"))
        value, present = _lookup(shipped, full)
        if present and value != spec.get("default"):
            default += f" ({_value(value)} in config/config.yaml)"
        meaning = " ".join(spec.get("description", "").split()).replace("|", "\\|")
        if spec.get("x-scheduling"):
            meaning += " Scheduling only: changing it re-runs nothing."
        lines.append(f"| `{full}` | {default} | {meaning} |")
    return "\n".join(lines) + "\n"


def render(text: str, schema_path=SCHEMA, shipped_path=SHIPPED) -> str:
    """`text` (config/README.md) with every marked table regenerated from the schema."""
    schema = yaml.safe_load(Path(schema_path).read_text())
    shipped = yaml.safe_load(Path(shipped_path).read_text()) or {}
    own = set(m.group(2) for m in TABLE.finditer(text))
    return TABLE.sub(lambda m: m.group(1) + table(schema, shipped, m.group(2), own) + m.group(4), text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when config/README.md's tables are stale")
    args = parser.parse_args(argv)
    text = README.read_text()
    new = render(text)
    if args.check:
        if new != text:
            print(f"{README}: key tables differ from {SCHEMA}; run python -m eaglepipe.tools.config_docs",
                  file=sys.stderr)
            return 1
        return 0
    README.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
