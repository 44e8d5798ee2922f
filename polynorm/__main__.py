"""``python -m polynorm``: the same command line as the ``polynorm`` script."""

import sys

from polynorm.cli import main

sys.exit(main())
