"""``python -m tensorcanon``: the command line (see tensorcanon.cli and docs/CLI.md)."""

import sys

from .cli import main

sys.exit(main())
