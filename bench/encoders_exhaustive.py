"""Every float32 bit pattern through the Numba quantized forward's encoders, against the casts.

The encoders of :mod:`polynorm.backends.numba.quant` (the 32-lane block
and the scalar tail) write ``q = encode(y / s)``; with a static scale of 1
that is ``encode(y)`` for every float32 ``y``.  This runs all 2**32 patterns
(rows of 4096, which the block encoder covers; a second pass with rows of
4095 puts 31 of every 4095 values through the scalar tail) and compares the
bytes with ``ml_dtypes``' float8_e4m3fn / float8_e5m2 casts after the clip to
+-448 / +-57344 (NaN kept, with its sign) and with ``rint`` clipped to
[-128, 127] for int8 (NaN -> 0).

    python bench/encoders_exhaustive.py [--chunk-log2 24] [--dtypes float8_e5m2 ...]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

TOP = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0, "int8": 127.0}


def expected(v: np.ndarray, qdtype: str) -> np.ndarray:
    """The casts the encoders implement, as uint8 bytes."""
    if qdtype != "int8":
        t = TOP[qdtype]
        return np.clip(v, -t, t).astype(getattr(ml_dtypes, qdtype)).view(np.uint8)
    with np.errstate(invalid="ignore"):
        r = np.rint(np.clip(np.nan_to_num(v, nan=0.0, posinf=127, neginf=-128), -128, 127))
    return r.astype(np.int8).view(np.uint8)


def main(argv: list[str] | None = None) -> int:
    from polynorm.backends.numba import quant as Q

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunk-log2", type=int, default=24)
    ap.add_argument("--dtypes", nargs="+", choices=list(TOP), default=list(TOP))
    args = ap.parse_args(argv)
    chunk = 1 << args.chunk_log2
    bad = 0
    t0 = time.perf_counter()
    for qdtype in args.dtypes:
        for width in (4096, 4095):
            for start in range(0, 1 << 32, chunk):
                v = np.arange(start, start + chunk, dtype=np.uint64).astype(np.uint32).view(
                    np.float32)
                rows = v.size // width
                y = np.ascontiguousarray(v[: rows * width].reshape(rows, width))
                q = np.empty(y.shape, np.uint8)
                Q.quantize_y_rows(0, rows, y, q, np.empty((1, 1), np.float32), np.float32(1.0),
                                  width, np.float32(TOP[qdtype]), Q.FMT[qdtype], False, True)
                want = expected(y, qdtype)
                diff = np.count_nonzero(q != want)
                if diff:
                    first = y[q != want][:4]
                    print(f"{qdtype} rows of {width}: {diff} "
                          f"differ from {start:#x}, e.g. {first.view(np.uint32)}")
                bad += diff
            what = "every pattern" if width == 4096 else "the patterns that fill whole rows"
            print(f"{qdtype} rows of {width}: {what} checked, "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
    print("differences:", bad)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
