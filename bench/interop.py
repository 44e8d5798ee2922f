"""Interop benchmark (torch tensors, polynorm.torch.RMSNorm, dask on a LocalCluster):
see :mod:`polynorm._bench.interop`.

    flock /tmp/polynorm-bench.lock python bench/interop.py [--quick] [--json PATH]
"""

import sys

from polynorm._bench.interop import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
