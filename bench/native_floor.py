"""What a minimal hand-written C kernel reaches on this CPU, beside polynorm and the roof.

The 16-bit forward's target is a fraction of a copy of the same bytes
(``polynorm.bench.roof``).  To tell what the algorithm costs on this machine
from what the Numba kernels leave on the table, this script compiles (gcc,
``-O3 -march=native -fopenmp``) the simplest fast RMSNorm forward of 16-bit
rows there is, with AVX-512 intrinsics, or AVX2 ones on CPUs without it: per
row, the sum of squares in float32 lanes, then ``y = x * rstd * w`` rounded
to the 16-bit type by the hardware (``vcvtne2ps2bf16`` / ``vcvtps2ph``; on
AVX2 bfloat16 by an integer round to nearest even) and written with plain or
streaming stores, rows over OpenMP threads.  It does none of polynorm's
work beyond that (no eps placement, partial, offset, bias, overflow-safe
statistics or fixed-order reductions).

Each is timed round-robin with the roof candidates into the same warm
``out=`` array (``paired_roof(kind="plain")``), so the ratios are paired.

Run::

    python bench/native_floor.py                 # bfloat16 and float16, 16384x4096 and 4096x16384
    python bench/native_floor.py --json bench/results/native-floor.json

Needs gcc and a CPU with AVX-512 (BF16 for bfloat16), or else AVX2 with F16C: 8 lanes,
float16 through ``vcvtps2ph``, bfloat16 rounded in integer ops; exits with a message otherwise.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

_SOURCE = r"""
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

/* one kernel, written over W float32 lanes: AVX-512 (16) or AVX2 + F16C (8) */
#ifdef __AVX512F__
#define W 16
typedef __m512 V;
typedef __m512i VI;
#define ZERO _mm512_setzero_ps
#define ADD _mm512_add_ps
#define MUL _mm512_mul_ps
#define FMA _mm512_fmadd_ps
#define SET1 _mm512_set1_ps
#define LOADF _mm512_loadu_ps
#define HSUM _mm512_reduce_add_ps
#define STORE(p, o) _mm512_storeu_si512((p), (o))
#define STREAM(p, o) _mm512_stream_si512((__m512i *)(p), (o))
static inline V ld_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline V ld_f16(const uint16_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
static inline VI pack_f16(V v0, V v1) {
    return _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm512_cvtps_ph(v0, _MM_FROUND_TO_NEAREST_INT)),
        _mm512_cvtps_ph(v1, _MM_FROUND_TO_NEAREST_INT), 1);
}
#ifdef __AVX512BF16__
#define HAS_BF16 1
static inline VI pack_bf16(V v0, V v1) { return (VI)_mm512_cvtne2ps_pbh(v1, v0); }
#else
#define HAS_BF16 0
#endif
#else
#define W 8
typedef __m256 V;
typedef __m256i VI;
#define ZERO _mm256_setzero_ps
#define ADD _mm256_add_ps
#define MUL _mm256_mul_ps
#define FMA _mm256_fmadd_ps
#define SET1 _mm256_set1_ps
#define LOADF _mm256_loadu_ps
#define STORE(p, o) _mm256_storeu_si256((__m256i *)(p), (o))
#define STREAM(p, o) _mm256_stream_si256((__m256i *)(p), (o))
static inline float HSUM(V a) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
static inline V ld_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline V ld_f16(const uint16_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
static inline VI pack_f16(V v0, V v1) {
    return _mm256_set_m128i(_mm256_cvtps_ph(v1, _MM_FROUND_TO_NEAREST_INT),
                            _mm256_cvtps_ph(v0, _MM_FROUND_TO_NEAREST_INT));
}
/* round to nearest even in integer ops (no NaN guard: the rows here hold none) */
static inline __m256i rne_bf16(V v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    return _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd,
                             _mm256_set1_epi32(0x7FFF))), 16);
}
#define HAS_BF16 1
static inline VI pack_bf16(V v0, V v1) {
    return _mm256_permute4x64_epi64(_mm256_packus_epi32(rne_bf16(v0), rne_bf16(v1)), 0xD8);
}
#endif

#define KERNEL(NAME, LD, PACK)                                                          \
void NAME(const uint16_t *x, const float *w, uint16_t *y, long n, long d, float eps,   \
          int stream) {                                                                \
    _Pragma("omp parallel for schedule(static)")                                       \
    for (long i = 0; i < n; i++) {                                                     \
        const uint16_t *xr = x + i * d;                                                \
        uint16_t *yr = y + i * d;                                                      \
        V a0 = ZERO(), a1 = a0, a2 = a0, a3 = a0;                                      \
        for (long j = 0; j < d; j += 4 * W) {                                          \
            V v0 = LD(xr + j), v1 = LD(xr + j + W);                                    \
            V v2 = LD(xr + j + 2 * W), v3 = LD(xr + j + 3 * W);                        \
            a0 = FMA(v0, v0, a0); a1 = FMA(v1, v1, a1);                                \
            a2 = FMA(v2, v2, a2); a3 = FMA(v3, v3, a3);                                \
        }                                                                              \
        float ss = HSUM(ADD(ADD(a0, a1), ADD(a2, a3)));                                \
        V r = SET1(1.0f / sqrtf(ss / d + eps));                                        \
        for (long j = 0; j < d; j += 2 * W) {                                          \
            V v0 = MUL(MUL(LD(xr + j), r), LOADF(w + j));                              \
            V v1 = MUL(MUL(LD(xr + j + W), r), LOADF(w + j + W));                      \
            VI o = PACK(v0, v1);                                                       \
            if (stream) STREAM(yr + j, o);                                             \
            else STORE(yr + j, o);                                                     \
        }                                                                              \
    }                                                                                  \
    if (stream) _mm_sfence();                                                          \
}

KERNEL(norm_f16, ld_f16, pack_f16)
#if HAS_BF16
KERNEL(norm_bf16, ld_bf16, pack_bf16)
#endif
int has_bf16(void) { return HAS_BF16; }
"""


def build(folder: str) -> ctypes.CDLL:
    """The C kernels as a shared library compiled in ``folder``."""
    src = Path(folder) / "floor.c"
    lib = Path(folder) / "floor.so"
    src.write_text(_SOURCE)
    subprocess.run(["gcc", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", str(src),
                    "-o", str(lib), "-lm"], check=True, capture_output=True, text=True)
    return ctypes.CDLL(str(lib))


def _c_call(fn, x: np.ndarray, w: np.ndarray, y: np.ndarray, stream: int):
    p16 = ctypes.POINTER(ctypes.c_uint16)
    args = (x.ctypes.data_as(p16), w.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
            y.ctypes.data_as(p16), ctypes.c_long(x.shape[0]), ctypes.c_long(x.shape[1]),
            ctypes.c_float(1e-6), ctypes.c_int(stream))

    def call(keep=(x, w, y)):  # the arrays live as long as their pointers
        fn(*args)
        return y

    return call


def _aligned_like(x: np.ndarray, align: int = 64) -> np.ndarray:
    """An empty array like ``x`` starting on an ``align``-byte boundary (the
    C kernel's streaming stores need whole aligned lines; rows of a multiple
    of 32 elements keep every row aligned)."""
    buf = np.empty(x.nbytes + align, np.uint8)
    start = -buf.ctypes.data % align
    return buf[start:start + x.nbytes].view(x.dtype).reshape(x.shape)


def measure(lib: ctypes.CDLL, dtype: str, n: int, d: int, min_time: float) -> dict:
    import ml_dtypes

    import polynorm as pn
    from polynorm.bench.roof import paired_roof

    np_t = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dtype]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, d), np.float32).astype(np_t)
    w = (1 + 0.1 * rng.standard_normal(d, np.float32)).astype(np.float32)
    wt = w.astype(np_t)
    y = _aligned_like(x)
    fn = lib.norm_bf16 if dtype == "bfloat16" else lib.norm_f16
    fn.restype = None
    w32 = wt.astype(np.float32)
    peers = {"c": _c_call(fn, x, w32, y, 0), "c_stream": _c_call(fn, x, w32, y, 1)}
    # the C kernel does the same arithmetic up to rounding: a check that it is the same work
    want = pn.rms_norm(x, wt).astype(np.float32)
    got = peers["c_stream"]().astype(np.float32)
    assert np.allclose(got, want, rtol=2e-2, atol=1e-2), "the C kernel computes something else"
    p = paired_roof(lambda: pn.rms_norm(x, wt, out=y), x, kind="plain", out=y,
                    min_time=min_time, peers=peers)
    row = {"dtype": dtype, "tokens": n, "d": d, "rounds": p.rounds, "roof": p.fastest,
           "roof_ms": p.roof_s * 1e3, "polynorm_ms": p.op_s * 1e3, "polynorm_speed": p.speed}
    for k, t in p.peers.items():
        row[f"{k}_ms"] = t * 1e3
        row[f"{k}_speed"] = p.roof_s / t
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"],
                    choices=["bfloat16", "float16"])
    ap.add_argument("--shapes", nargs="+", default=["16384x4096", "4096x16384"])
    ap.add_argument("--min-time", type=float, default=1.0, help="seconds per case and candidate")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="polynorm-floor-") as tmp:
        try:
            lib = build(tmp)
        except (OSError, subprocess.CalledProcessError) as e:
            print(f"cannot build the C kernels here: {getattr(e, 'stderr', e)}", file=sys.stderr)
            return 1
        threads = os.environ.get("OMP_NUM_THREADS")
        rows = []
        print("16-bit forward, out= (warm output): median ms, and the roof's time over each "
              "(1 = as fast as the fastest copy of the same bytes in its round)")
        for dtype in args.dtypes:
            if dtype == "bfloat16" and not lib.has_bf16():
                print("bfloat16: this AVX-512 CPU has no BF16; skipped")
                continue
            for shape in args.shapes:
                n, d = map(int, shape.split("x"))
                if d % 64:
                    ap.error(f"{shape}: the C kernel takes rows of a multiple of 64 elements")
                r = measure(lib, dtype, n, d, args.min_time)
                rows.append(r)
                print(f"{dtype:9s} {shape:>11s}  roof ({r['roof']}) {r['roof_ms']:6.2f} ms   "
                      f"polynorm {r['polynorm_ms']:6.2f} ({r['polynorm_speed']:.2f})   "
                      f"C {r['c_ms']:6.2f} ({r['c_speed']:.2f})   "
                      f"C streaming {r['c_stream_ms']:6.2f} ({r['c_stream_speed']:.2f})",
                      flush=True)
    if args.json:
        from numba import get_num_threads

        from polynorm.bench.common import machine_info

        meta = {**machine_info(), "numba_threads": get_num_threads(), "omp_threads": threads,
                "command": "python bench/native_floor.py " + " ".join(argv or sys.argv[1:])}
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
