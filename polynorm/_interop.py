"""Zero-copy views between the caller's arrays and a backend's native arrays.

The compiled backends work on numpy arrays (CPU, the Numba kernels) and cupy
arrays (CUDA).  These helpers turn the caller's array into such a view
through DLPack and wrap results back into the caller's type, so that each
backend module converts in exactly one place.

bfloat16 has no numpy dtype of its own; it is represented by
``ml_dtypes.bfloat16`` arrays, and the Numba kernels take ``uint16`` views.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def is_host_array(a: Any) -> bool:
    """True for arrays in CPU memory that :func:`to_numpy` can view without a copy."""
    return type(a) is np.ndarray


def to_numpy(a: Any) -> np.ndarray | None:
    """A numpy view of a host array (``None`` passes through)."""
    if a is None or type(a) is np.ndarray:
        return a
    raise TypeError(f"cannot view {type(a).__name__} as a numpy array")


def from_numpy(a: np.ndarray | None, like: Any) -> Any:
    """Wrap numpy result ``a`` into the array type of ``like`` (zero-copy)."""
    if a is None or type(like) is np.ndarray:
        return a
    raise TypeError(f"cannot wrap a numpy array as {type(like).__name__}")
