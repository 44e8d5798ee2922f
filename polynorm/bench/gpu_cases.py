"""The GPU benchmark's cases and the bytes each op must move.

Shared by the benchmark (:mod:`polynorm.bench.gpu`) and the launch model
(:mod:`polynorm.bench.model`), which predicts the same cases.
"""

from __future__ import annotations

TOKENS = (4096, 32768, 128, 1)  # the targets are at >= 4096 tokens: measured first
HIDDEN = (1024, 4096, 8192, 16384, 65536, 262144)
#: (tokens, d) measured besides TOKENS x HIDDEN
EXTRA_SHAPES = ((1 << 21, 128), (8, 262144), (4096, 65536))
OPS = ("fwd", "add", "bwd", "gated", "quant")
DTYPES = ("bfloat16", "float16", "float32")
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


def cases(quick: bool = False, dtypes: list[str] | None = None) -> list[tuple[str, str, int, int]]:
    """(op, dtype, tokens, d) in the order they are measured.

    >>> len(cases()), cases(quick=True)[0]
    (390, ('fwd', 'bfloat16', 4096, 4096))
    """
    tokens = (4096,) if quick else TOKENS
    hidden = (4096, 65536) if quick else HIDDEN
    dts = [d for d in DTYPES if dtypes is None or d in dtypes]
    out = [(op, dt, n, d) for n in tokens for dt in dts for d in hidden for op in OPS]
    # the per-head QK-norm shape and few rows of a huge d (one block per row)
    extra = [(op, dt, n, d) for (n, d) in (EXTRA_SHAPES[:1] if quick else EXTRA_SHAPES)
             for dt in dts for op in OPS]
    return out + [c for c in extra if c not in out]


def op_bytes(op: str, dtype: str, n: int, d: int) -> int:
    """Bytes the op must move: each token-sized array once, plus weight (quant: x,
    residual and h at the dtype's size, q at one byte per element).

    >>> op_bytes("fwd", "bfloat16", 2, 8), op_bytes("quant", "bfloat16", 2, 8)
    (80, 128)
    """
    a = n * d * ITEMSIZE[dtype]
    w = d * ITEMSIZE[dtype]
    return {"fwd": 2 * a + w, "add": 4 * a + w, "bwd": 3 * a + 2 * w, "gated": 3 * a + w,
            "quant": 3 * a + n * d + w}[op]
