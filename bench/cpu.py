"""CPU benchmark of the Numba backend: see :mod:`polynorm._bench.cpu`.

    flock /tmp/polynorm-bench.lock python bench/cpu.py [--quick] [--json PATH] [--threshold | --stream]
"""

import sys

from polynorm._bench.cpu import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
