"""``python -m polynorm``: the same command line as the ``polynorm`` script."""

import sys

from .cli import main

sys.exit(main())
