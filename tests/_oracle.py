"""An independent float64 / extended-precision transcription of ``shared/SPEC.md``.

This is the ground truth the whole suite compares against.  It does **not**
import polynorm: it re-derives ``k``, eps placement, the dtype rules and the
backward from the spec text, in plain numpy, so that a mistake in
``polynorm.core.options`` or ``polynorm.ops.norm`` cannot hide in both places.

* The math runs in ``np.longdouble`` (80-bit on x86-64: 64-bit significand,
  exponent range to 1e4932), so squares of float64 ``1e200`` and ``1e-200``
  neither overflow nor underflow; results are rounded to float64 at the end.
* The backward is the spec's own ``x * rstd**3 / k`` form (and its
  eps-outside counterpart, derived below), *not* polynorm's ``xhat`` form.
* Layout is handled here with ``np.moveaxis`` + ``reshape``, independently
  of polynorm's own layout code.

Tolerances for comparing a backend's result with the oracle are in
:data:`TOL`, with their justification.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import NamedTuple

import ml_dtypes
import numpy as np

NP_DTYPES = {
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
}

#: True where np.longdouble has a wider exponent range than float64 (x86-64
#: Linux, aarch64).  The float64 huge/tiny tests need it; elsewhere they skip.
EXTENDED = np.finfo(np.longdouble).maxexp >= 16384

LD = np.longdouble


class Tol(NamedTuple):
    rtol: float
    atol: float  # relative to the largest magnitude of the expected array (see assert_close)
    floor: float = 0.0  # absolute: one smallest subnormal, the spacing below the normal range


#: Per output dtype.  A correct backend computes in float32 (float64 for
#: float64) and rounds ONCE to the output dtype, an error of 0.5 ulp; the
#: float32 compute adds ~ d * 2**-24 relative for the sum of squares (d <= 64
#: in these tests, so < 4e-6, i.e. far below a half-precision ulp).
#: ``casting="llama"`` rounds up to three times (xhat to x's dtype, the
#: product, the output), < 1.5 ulp.  Hence 2 ulp at 1.0 for the half types:
#:
#: * float16:  2 * 2**-10 (10 fraction bits)
#: * bfloat16: 2 * 2**-7  (7 fraction bits)
#: * float32:  1e-5 -- ~80 ulp of 2**-23: the float32 reductions (sum of
#:   squares over d, the backward's sum over d and dweight's sum over tokens)
#:   each lose up to ~d * 2**-24 relative in the worst case.
#: * float64:  1e-12 -- the same argument with 2**-53, plus headroom for the
#:   extended-vs-double difference in the oracle.
#:
#: ``atol`` is relative to ``max|expected|`` of the compared array, so that
#: entries that nearly cancel (``y`` near 0, ``dx`` where both terms of the
#: backward are equal) are judged against the array's scale, and the test
#: works unchanged for values of 1e-25 or 1e25.  ``floor`` is the dtype's
#: smallest subnormal: a result correctly rounded into the subnormal range
#: (float16 below 6.1e-5) is only that accurate in absolute terms.
TOL: dict[str, Tol] = {
    "float16": Tol(2 * 2.0**-10, 2 * 2.0**-10, 2.0**-24),
    "bfloat16": Tol(2 * 2.0**-7, 2 * 2.0**-7, 2.0**-133),
    "float32": Tol(1e-5, 1e-5, 2.0**-149),
    "float64": Tol(1e-12, 1e-12, 2.0**-1074),
}

_RANK = {"float16": 1, "bfloat16": 1, "float32": 2, "float64": 3}


def promote(a: str, b: str) -> str:
    """The usual float promotion (torch/jax/array-API): float16+bfloat16 -> float32."""
    if a == b:
        return a
    if _RANK[a] == _RANK[b]:
        return "float32"
    return a if _RANK[a] > _RANK[b] else b


def dtype_name(a: np.ndarray) -> str:
    for name, dt in NP_DTYPES.items():
        if a.dtype == dt:
            return name
    raise TypeError(a.dtype)


def looser(*dtypes: str) -> Tol:
    """The loosest tolerance among ``dtypes`` (e.g. x's dtype and the output dtype)."""
    return max((TOL[d] for d in dtypes), key=lambda t: (t.rtol, t.floor))


def assert_close(got, want, dtype: str | Tol, what: str = "", scale: float | None = None) -> None:
    """``|got - want| <= rtol*|want| + atol*scale + floor`` elementwise; NaN/Inf must match.

    ``scale`` defaults to ``max|want|`` over the finite entries (1 if all are 0).
    """
    tol = TOL[dtype] if isinstance(dtype, str) else dtype
    got = np.asarray(got).astype(np.float64)
    want = np.asarray(want).astype(np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    fin = np.isfinite(want)
    np.testing.assert_array_equal(
        np.isnan(got), np.isnan(want), err_msg=f"{what}: NaN positions differ"
    )
    np.testing.assert_array_equal(
        got[np.isinf(want)], want[np.isinf(want)], err_msg=f"{what}: Inf entries differ"
    )
    if scale is None:
        scale = float(np.max(np.abs(want[fin]))) if fin.any() else 1.0
        scale = scale if scale > 0 else 1.0
    err = np.abs(got[fin] - want[fin])
    bound = tol.rtol * np.abs(want[fin]) + tol.atol * scale + tol.floor
    bad = err > bound
    if bad.any():
        i = int(np.argmax(err - bound))
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {err.size} entries off; worst: got {got[fin][i]!r}, "
            f"want {want[fin][i]!r} (err {err[i]:.3g} > bound {bound[i]:.3g}; tol {tol}, scale {scale:.3g})"
        )


# ------------------------------------------------------------------------ layout


def _axes(axis, ndim: int) -> tuple[int, ...]:
    items = axis if isinstance(axis, tuple) else (axis,)
    return tuple(sorted(a % ndim for a in items))


def to_rows(a: np.ndarray, axis) -> np.ndarray:
    """``(tokens, d)`` rows: the normalized axes (sorted) moved last, C order."""
    axes = _axes(axis, a.ndim)
    moved = np.moveaxis(a, axes, tuple(range(a.ndim - len(axes), a.ndim)))
    d = math.prod(a.shape[i] for i in axes)
    return moved.reshape(-1, d)


def from_rows(r: np.ndarray, shape: tuple[int, ...], axis) -> np.ndarray:
    """Inverse of :func:`to_rows` for an array of shape ``shape``."""
    axes = _axes(axis, len(shape))
    rest = [i for i in range(len(shape)) if i not in axes]
    moved_shape = tuple(shape[i] for i in rest) + tuple(shape[i] for i in axes)
    moved = r.reshape(moved_shape)
    return np.moveaxis(moved, tuple(range(len(shape) - len(axes), len(shape))), axes)


def batch_shape(shape: tuple[int, ...], axis) -> tuple[int, ...]:
    axes = _axes(axis, len(shape))
    return tuple(s for i, s in enumerate(shape) if i not in axes)


# ------------------------------------------------------------------------ the operation


def k_of(d: int, partial: float, partial_size: int | None = None) -> int:
    """``k``: ``partial_size`` when given, else ``floor(d * partial)`` of the exact
    value of ``partial`` -- except for a ``partial`` that is the double nearest to
    ``(k + 1) / d``, which means ``k + 1``.

    So ``d = 100, partial = 0.29`` gives 29, although ``100 * 0.29`` is
    ``28.999999999999996`` in floating point (the pRMSNorm paper's ``int(d * p)``
    gives 28), and one ulp below 0.29 gives 28.
    """
    if partial_size is not None:
        return partial_size
    k = math.floor(Fraction(partial) * d)
    if k < d and float(Fraction(k + 1, d)) == partial:  # float(Fraction): correctly rounded
        return k + 1
    return k


def _stats(v: np.ndarray, k: int, eps: float, eps_mode: str):
    """``(ms, rstd)`` per row of extended-precision rows ``v``."""
    ms = np.sum(v[:, :k] * v[:, :k], axis=1) / LD(k)
    if eps_mode == "inside":
        rstd = LD(1) / np.sqrt(ms + LD(eps))
    else:
        rstd = LD(1) / (np.sqrt(ms) + LD(eps))
    return ms, rstd


def _round(a: np.ndarray, dtype: str) -> np.ndarray:
    """Round extended ``a`` to ``dtype`` (one rounding, through float64 for halves)."""
    if dtype in ("float16", "bfloat16"):
        # longdouble -> float64 -> half is a double rounding, harmless here:
        # it only differs from one rounding at exact ties of the float64 value.
        return a.astype(np.float64).astype(NP_DTYPES[dtype])
    return a.astype(NP_DTYPES[dtype])


def add(x: np.ndarray, residual: np.ndarray) -> np.ndarray:
    """``h = x + residual``, rounded once to ``promote(x, residual)``."""
    hdt = promote(dtype_name(x), dtype_name(residual))
    return _round(x.astype(LD) + residual.astype(LD), hdt)


def forward(
    x: np.ndarray,
    weight: np.ndarray | None = None,
    bias: np.ndarray | None = None,
    *,
    eps: float = 1e-6,
    axis=-1,
    partial: float = 1.0,
    partial_size: int | None = None,
    offset: float = 0.0,
    eps_mode: str = "inside",
    casting: str = "fp32",
    out_dtype: str | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """``(y, rstd)``, float64, for numpy ``x`` of any float dtype (ml_dtypes for bfloat16).

    With ``casting="fp32"`` ``y`` is the exact value (to ~1e-18), not rounded
    to any output dtype; the caller compares with :data:`TOL` of the output
    dtype.  With ``casting="llama"`` the roundings Hugging Face Llama makes
    are emulated: ``xhat`` rounded to ``x``'s dtype, ``weight + offset``
    rounded to the weight's dtype, the product rounded to
    ``promote(x, weight)``, bias added, and the result rounded to the output
    dtype (``out_dtype``, default ``x``'s).
    """
    shape = x.shape
    v = to_rows(x, axis).astype(LD)
    d = v.shape[1]
    k = k_of(d, partial, partial_size)
    assert 1 <= k <= d, (d, partial)
    _, rstd = _stats(v, k, eps, eps_mode)
    xhat = v * rstd[:, None]
    w = None if weight is None else weight.reshape(-1)
    b = None if bias is None else bias.reshape(-1)
    if casting == "llama":
        xdt = dtype_name(x)
        xhat = _round(xhat, xdt).astype(LD)
        if w is not None:
            wdt = dtype_name(weight)
            g = _round(w.astype(LD) + LD(offset), wdt).astype(LD)
            xhat = _round(xhat * g, promote(xdt, wdt)).astype(LD)
        y = xhat if b is None else xhat + b.astype(LD)
        y = _round(y, out_dtype or xdt).astype(LD)
    else:
        y = xhat if w is None else xhat * (w.astype(LD) + LD(offset))
        if b is not None:
            y = y + b.astype(LD)
    y = from_rows(y.astype(np.float64), shape, axis)
    return y, rstd.astype(np.float64).reshape(batch_shape(shape, axis))


def backward(
    dy: np.ndarray,
    x: np.ndarray,
    weight: np.ndarray | None = None,
    bias: np.ndarray | None = None,
    *,
    eps: float = 1e-6,
    axis=-1,
    partial: float = 1.0,
    partial_size: int | None = None,
    offset: float = 0.0,
    eps_mode: str = "inside",
    grad_residual: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """``(dx, dweight, dbias)`` in float64, from the spec's ``rstd**3`` formula.

    With ``g = weight + offset`` (1 without weight), ``S = sum_j(g*dy*x)_j``
    over all ``d`` columns and ``m_i = [i < k]``:

    * eps inside, ``rstd = (ms + eps)**-1/2``, ``d rstd / d x_i = -m_i x_i rstd**3 / k``::

          dx = rstd*g*dy - m * x * rstd**3 / k * S

    * eps outside, ``rstd = 1 / (s + eps)`` with ``s = sqrt(ms)``,
      ``d s / d x_i = m_i x_i / (k s)``, so ``d rstd / d x_i = -m_i x_i rstd**2 / (k s)``::

          dx = rstd*g*dy - m * x * rstd**2 / (k*s) * S      (0 where s == 0: x_i = 0 there)

    * ``dweight = sum over tokens of dy * x * rstd``, ``dbias = sum over tokens of dy``.
    """
    shape = x.shape
    v = to_rows(x, axis).astype(LD)
    gy = to_rows(dy, axis).astype(LD)
    d = v.shape[1]
    k = k_of(d, partial, partial_size)
    ms, rstd = _stats(v, k, eps, eps_mode)
    g = LD(1) if weight is None else weight.reshape(-1).astype(LD) + LD(offset)
    S = np.sum(g * gy * v, axis=1)
    if eps_mode == "inside":
        coef = rstd**3 / LD(k) * S
    else:
        s = np.sqrt(ms)
        safe = np.where(s == 0, LD(1), s)
        coef = np.where(s == 0, LD(0), rstd**2 / (LD(k) * safe) * S)
    m = (np.arange(d) < k).astype(LD)
    dx = rstd[:, None] * g * gy - m[None, :] * v * coef[:, None]
    if grad_residual is not None:
        dx = dx + to_rows(grad_residual, axis).astype(LD)
    dweight = None
    if weight is not None:
        dweight = np.sum(gy * v * rstd[:, None], axis=0).astype(np.float64).reshape(weight.shape)
    dbias = None if bias is None else np.sum(gy, axis=0).astype(np.float64).reshape(bias.shape)
    return from_rows(dx.astype(np.float64), shape, axis), dweight, dbias


def hf_llama_rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """A literal numpy transcription of Hugging Face ``LlamaRMSNorm.forward``::

        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)

    The result has the promoted dtype of ``weight`` and ``x``, as in torch.
    """
    h = x.astype(np.float32)
    variance = np.mean(h**2, axis=-1, keepdims=True, dtype=np.float32)
    h = h * (np.float32(1) / np.sqrt(variance + np.float32(eps)))
    h = h.astype(x.dtype)
    out = promote(dtype_name(weight), dtype_name(x))
    return weight.astype(NP_DTYPES[out]) * h.astype(NP_DTYPES[out])
