"""How often a float32 statistic would change rstd's bits (why pn_fwd_rows keeps the double tree).

bfloat16 rows of d = 4096 (standard normal): SPEC's statistic sums exact squares in
double and rounds rstd once to float32; the variants below use a float32 sum of squares
(warp-sized partial sums, as the peers' kernels do) and/or a float32 epilogue, and count
the rows whose float32 rstd differs.  Run: ``python bench/f32_statistic_bits.py``.
"""

import ml_dtypes
import numpy as np


def main() -> None:
    rng = np.random.default_rng(0)
    n, d, eps = 4000, 4096, 1e-6
    x = rng.standard_normal((n, d)).astype(ml_dtypes.bfloat16).astype(np.float32)
    ss = (x.astype(np.float64) ** 2).sum(1)
    r64 = (1 / np.sqrt(ss / d + eps)).astype(np.float32)
    sq = (x * x).astype(np.float32)
    s32 = sq.reshape(n, -1, 32).sum(2, dtype=np.float32).sum(1, dtype=np.float32)
    r32 = np.float32(1) / np.sqrt(s32 / np.float32(d) + np.float32(eps))
    r32d = (1 / np.sqrt(s32.astype(np.float64) / d + eps)).astype(np.float32)
    r3 = np.float32(1) / np.sqrt(ss.astype(np.float32) / np.float32(d) + np.float32(eps))
    print(f"float32 sum + float32 epilogue: {(r32 != r64).mean():.3f} of rows differ")
    print(f"float32 sum + double epilogue:  {(r32d != r64).mean():.3f}")
    print(f"exact sum + float32 epilogue:   {(r3 != r64).mean():.3f}")


if __name__ == "__main__":
    main()
