"""Make a draft bundle (format: eaglepipe/bundle.py) from a finished workflow directory, to bench that draft on
another machine with `bench.draft` (config/examples/serve-draft.yaml).

Usage: python -m eaglepipe.tools.bundle --directory W --out DIR
"""

from __future__ import annotations

import argparse
import sys

from .. import bundle


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--directory", default=".", help="the workflow directory (snakemake --directory); default .")
    parser.add_argument("--out", required=True, help="the bundle folder to create (must not exist)")
    args = parser.parse_args(argv)
    try:
        out = bundle.make(args.directory, args.out)
    except (FileNotFoundError, FileExistsError) as err:
        sys.exit(f"error: {err}")
    names = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    print(f"draft bundle {out}: {', '.join(names)}")


if __name__ == "__main__":
    main()
