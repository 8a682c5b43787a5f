"""``python -m specjet.train <job> [options]``: run one training job (``<job> --help`` for its options)."""
from __future__ import annotations

import importlib
import sys

JOBS = {"eagle": "specjet.train.eagle", "dflash": "specjet.train.dflash"}  # job -> module with main(argv)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in JOBS:
        print(f"usage: python -m specjet.train {{{','.join(JOBS)}}} [options]")
        if argv and argv[0] not in ("-h", "--help"):
            print(f"unknown job {argv[0]!r}", file=sys.stderr)
            raise SystemExit(2)
        return
    importlib.import_module(JOBS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    main()
