"""GPU benchmark (cupy backend vs copy, torch, torch.compile, Liger, QuACK): see polynorm/bench/gpu.py.

    python bench/gpu.py [--quick] [--dtypes bfloat16 ...] [--out PATH] [--dry-run]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from polynorm.bench.gpu import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
