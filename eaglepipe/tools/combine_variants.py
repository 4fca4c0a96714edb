"""A sweep's second pass: one variant combining the winners of the first (variants.combination).

    python -m eaglepipe.tools.combine_variants --table RUN/results/variants/variants.json \
        [--name combined] --out combined.yaml

Writes a config file adding that variant (train.variants.<name>: the merged overrides) to give after the sweep's own
config files: Snakemake then trains and scores only the new variant and compares it with the others. Writes nothing
and says so when fewer than two variants beat the baseline (exit status 0; the file's absence is the answer).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import yaml

from ..formats import atomic_path
from ..variants import combination

log = logging.getLogger(__name__)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", required=True, help="variants.json of the first pass")
    parser.add_argument("--name", default="combined", help="the combined variant's name")
    parser.add_argument("--out", required=True, help="the config file to write")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    table = json.loads(Path(args.table).read_text())
    taken = [r["name"] for r in table["variants"]]
    if args.name in taken:
        raise SystemExit(f"{args.table} already has a variant named {args.name}: give another --name")
    overrides = combination(table)
    if overrides is None:
        log.info("fewer than two variants beat the baseline in %s: nothing to combine, %s not written", args.table,
                 args.out)
        return 0
    with atomic_path(args.out) as tmp:
        Path(tmp).write_text(f"# the winners of {args.table} combined (python -m eaglepipe.tools.combine_variants)\n"
                             + yaml.safe_dump({"train": {"variants": {args.name: overrides}}}, sort_keys=True))
    log.info("wrote %s: variant %s = %s", args.out, args.name, overrides)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
