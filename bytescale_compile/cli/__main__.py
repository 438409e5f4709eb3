"""`python -m bytescale_compile.cli`: the `bytescale-compile` command."""

import sys

from .commands import main

sys.exit(main())
