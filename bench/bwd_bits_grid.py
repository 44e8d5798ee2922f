"""A hash of the Numba backward's output bits over a grid of cases, to compare two revisions.

The grid: 4 dtypes, a serial (37x130) and a parallel (600x4096) shape, weight, bias,
grad_residual and rstd each given or not, both eps modes, eps 0 and 1e-6, partial 1
and 0.5, with a zero row and a row of tiny values.  Prints the number of output arrays
and the md5 of their bytes; the same hash means the same bits everywhere::

    POLYNORM_CACHE_DIR=$(mktemp -d) python bench/bwd_bits_grid.py
    git worktree add /tmp/old REV
    POLYNORM_CACHE_DIR=$(mktemp -d) PYTHONPATH=/tmp/old python bench/bwd_bits_grid.py

(the first run compiles every variant: a few minutes).
"""

import hashlib
import itertools

import ml_dtypes
import numpy as np

import polynorm as pn


def main() -> None:
    h = hashlib.md5()
    cnt = 0
    rng = np.random.default_rng(1)
    cases = itertools.product(
        [np.float32, np.float64, np.float16, ml_dtypes.bfloat16], [(37, 130), (600, 4096)],
        [0, 1], [0, 1], [0, 1], ["inside", "outside"], [0.0, 1e-6], [0, 1], [1.0, 0.5])
    for dt, (n, d), has_w, has_b, has_g, mode, eps, give, part in cases:
        x = rng.standard_normal((n, d)).astype(dt)
        x[3] = 0
        x[5, :7] = 1e-30 if dt in (np.float32, np.float64) else 0
        dy = rng.standard_normal((n, d)).astype(dt)
        w = rng.standard_normal(d).astype(dt) if has_w else None
        b = rng.standard_normal(d).astype(dt) if has_b else None
        g = rng.standard_normal((n, d)).astype(dt) if has_g else None
        opts = dict(eps=eps, eps_mode=mode, partial=part)
        rstd = pn.rms_norm(x, w, b, return_rstd=True, **opts)[1] if give else None
        for a in pn.rms_norm_backward(dy, x, w, b, rstd=rstd, grad_residual=g, **opts):
            if a is not None:
                h.update(np.ascontiguousarray(a).tobytes())
                cnt += 1
    print(cnt, h.hexdigest())


if __name__ == "__main__":
    main()
