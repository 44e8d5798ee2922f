"""Interop benchmark (torch tensors, polynorm.torch.RMSNorm, dask on a LocalCluster):
see :mod:`polynorm.bench.interop`.

    flock /tmp/polynorm-bench.lock python bench/interop.py [--quick] [--json PATH]
"""

import sys
from pathlib import Path

# this checkout's polynorm, not whichever one the environment has installed
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from polynorm.bench.interop import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
