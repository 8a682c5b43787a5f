"""``python -m specjet.serve [flags]``: the same as ``specjet serve``."""
import sys

from specjet.serve.cli import main

sys.exit(main())
