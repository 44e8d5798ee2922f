"""CPU benchmark of the Numba backend: see :mod:`polynorm.bench.cpu`.

    flock /tmp/polynorm-bench.lock python bench/cpu.py [--quick] [--json PATH] [--threshold | --stream]
"""

import sys
from pathlib import Path

# this checkout's polynorm, not whichever one the environment has installed
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from polynorm.bench.cpu import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
