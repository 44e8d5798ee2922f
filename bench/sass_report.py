"""Machine-code report of the CUDA kernels (no GPU): see polynorm/bench/sass.py.

    python bench/sass_report.py [--arch sm_90] [--filter pn_fwd] [--out bench/results/sass-DATE.json]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from polynorm.bench.sass import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
