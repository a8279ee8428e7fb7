"""`python -m rlgraph ...` works like the `rlgraph` command."""

import sys

from rlgraph.cli import main

sys.exit(main())
