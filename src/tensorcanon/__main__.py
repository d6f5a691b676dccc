"""``python -m tensorcanon``: the command line (see tensorcanon.tools.cli and docs/CLI.md)."""

import sys

from .tools.cli import main

sys.exit(main())
