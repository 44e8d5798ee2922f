"""Memory-lean training: the backward from the forward's output instead of its input.

``save="output"`` (:mod:`polynorm.torch`, :mod:`polynorm.jax`) keeps ``y`` and
``rstd`` for the backward instead of ``x`` (``h`` for the fused add).  The
layer after a norm (a linear projection) keeps ``y`` anyway, so the norm's
own copy of its input is what is saved: one activation of ``x``'s size per
norm.  The backward recovers the normalized value from ``y``::

    xhat = (y - bias) / (weight + offset)          # weight None: y - bias
    x    = xhat / rstd                             # in the compute dtype

and runs the ordinary hand-written backward on that ``x`` with the saved
``rstd``.  This is exact in exact arithmetic; in floating point ``xhat``
carries ``y``'s rounding (one unit in ``y``'s last place, relative: bfloat16's
2**-8 for a bfloat16 ``y``), so the gradients agree with ``save="input"`` to
``y``'s precision, not bit for bit.  With a bias much larger than ``xhat * g``
the subtraction loses more.  Columns where ``weight + offset == 0`` hold no
trace of ``x``: there the input must be saved (see each front end's rule).

Written once, on the array API, for every front end.
"""

from __future__ import annotations

from typing import Any

import array_api_compat as aac

__all__ = ["SAVES", "check_save", "recover_input", "recoverable"]

#: what the forward keeps for the backward
SAVES = ("input", "output")


def check_save(save: Any) -> str:
    """``save`` validated: one of :data:`SAVES`, else a ``ValueError`` naming it.

    >>> check_save("output")
    'output'
    """
    if not isinstance(save, str) or save not in SAVES:
        raise ValueError(f"save must be one of {SAVES}, got {save!r}")
    return save


def _at_axes(xp, a, shape: tuple[int, ...], axes: tuple[int, ...], keep: bool):
    """``a`` reshaped to broadcast against ``shape``: ``keep`` the normalized axes
    (weight/bias, shaped over them) or the others (rstd, shaped without them)."""
    target = tuple((s if (i in axes) == keep else 1) for i, s in enumerate(shape))
    return xp.reshape(a, target)


def recoverable(weight: Any, offset: float, compute_dtype: Any) -> bool:
    """Whether ``weight + offset`` has no zero (always, without a weight): the input can
    be recovered from the output.  Reads the data (a device sync on a GPU)."""
    if weight is None:
        return True
    xp = aac.array_namespace(weight)
    return not bool(xp.any(xp.astype(weight, compute_dtype) + offset == 0))


def recover_input(y, weight, bias, rstd, axes: tuple[int, ...], offset: float):
    """The forward's input, from its output ``y`` and ``rstd``, in ``rstd``'s dtype.

    ``axes`` are the normalized axes (non-negative, sorted); ``weight``/``bias``
    have ``y``'s shape over them, ``rstd`` its shape without them.  Where
    ``weight + offset == 0`` the result is NaN (nothing of ``x`` is left there).

    >>> import numpy as np
    >>> import polynorm as pn
    >>> x = np.array([[3.0, 4.0]]); w = np.array([2.0, 0.5])
    >>> y, rstd = pn.rms_norm(x, w, eps=0.0, return_rstd=True)
    >>> recover_input(y, w, None, rstd, (1,), 0.0)
    array([[3., 4.]])
    """
    xp = aac.array_namespace(y, rstd)
    shape = tuple(y.shape)
    cdt = rstd.dtype
    v = xp.astype(y, cdt)
    if bias is not None:
        v = v - _at_axes(xp, xp.astype(bias, cdt), shape, axes, True)
    if weight is not None:
        v = v / (_at_axes(xp, xp.astype(weight, cdt), shape, axes, True) + offset)
    return v / _at_axes(xp, rstd, shape, axes, False)
