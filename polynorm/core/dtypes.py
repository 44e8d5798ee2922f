"""dtype names across array libraries.

polynorm speaks of dtypes by name (``"float16"``, ``"bfloat16"``,
``"float32"``, ``"float64"``) so that the semantics in :mod:`polynorm.core.options`
do not depend on any one library's dtype objects.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

#: the floating dtypes polynorm computes on, by name (the order tables and CLI choices use)
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")

_NUMPY_DTYPES: dict[str, np.dtype] = {}
_NAMES: dict[type, str] = {}
_VOID = np.dtypes.VoidDType  # structured and raw bytes: one class, many names


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a float dtype name (bfloat16 from ``ml_dtypes``); cached.

    >>> numpy_dtype("float32"), numpy_dtype("bfloat16").name
    (dtype('float32'), 'bfloat16')
    """
    dt = _NUMPY_DTYPES.get(name)
    if dt is None:
        if name == "bfloat16":
            import ml_dtypes

            dt = np.dtype(ml_dtypes.bfloat16)
        else:
            dt = np.dtype(name)
        _NUMPY_DTYPES[name] = dt
    return dt


def dtype_name(dtype: Any) -> str:
    """Library-neutral name of a dtype object (numpy, torch, jax, cupy, strict).

    >>> import numpy as np
    >>> dtype_name(np.dtype("float32"))
    'float32'
    """
    kind = type(dtype)
    if isinstance(dtype, np.dtype) and kind is not _VOID and dtype.kind not in "MmSUO":
        # numpy's dtype.name is a Python property of ~2 us; a fixed-size dtype
        # (ml_dtypes' included) has one class per name, whatever its byte order
        name = _NAMES.get(kind)
        if name is None:
            name = _NAMES[kind] = dtype.name
        return name
    name = getattr(dtype, "name", None)
    if not isinstance(name, str):
        name = str(dtype)
    return name.rsplit(".", 1)[-1].lower()


def float_dtype_name(argname: str, arr: Any) -> str:
    """The float dtype name of ``arr``, or a ``TypeError`` naming ``argname``."""
    name = dtype_name(arr.dtype)
    if name == "half":
        name = "float16"
    if name not in FLOAT_DTYPES:
        raise TypeError(
            f"{argname} must have a floating dtype ({', '.join(FLOAT_DTYPES)}), got {name}"
        )
    return name


def parse_dtype(argname: str, dtype: Any) -> str | None:
    """Accept ``None``, a dtype name or a dtype object; return a float dtype name.

    dtype objects of any library (``np.dtype``, ``torch.float16``, a jax or
    cupy dtype) and the scalar types numpy takes as dtypes (``np.float16``,
    ``ml_dtypes.bfloat16``, ``jnp.bfloat16``) name the same four dtypes.

    >>> import numpy as np, ml_dtypes
    >>> parse_dtype("out_dtype", np.float16), parse_dtype("out_dtype", ml_dtypes.bfloat16)
    ('float16', 'bfloat16')
    """
    if dtype is None:
        return None
    if isinstance(dtype, str):
        name = dtype
    elif isinstance(dtype, type):
        # a scalar type: its str() is "<class 'numpy.float16'>", numpy knows its dtype
        import numpy as np

        try:
            name = np.dtype(dtype).name
        except TypeError:
            name = dtype.__name__
    else:
        name = dtype_name(dtype)
    if name == "half":
        name = "float16"
    if name not in FLOAT_DTYPES:
        raise TypeError(f"{argname} must be one of {FLOAT_DTYPES} (or None), got {dtype!r}")
    return name


def namespace_dtype(xp: ModuleType, name: str, like: Any = None) -> Any:
    """The dtype object called ``name`` in namespace ``xp``.

    bfloat16 is not part of the array API standard: it is looked up in the
    library behind ``xp`` (torch, jax) or, for numpy-like namespaces, taken
    from ``ml_dtypes``.
    """
    dt = getattr(xp, name, None)
    if dt is not None:
        return dt
    # Not in the namespace itself: bfloat16 is outside the standard, and some
    # compat namespaces (array_api_compat.dask.array) omit float16 too.
    module = type(like).__module__.split(".")[0] if like is not None else ""
    if module == "torch":
        import torch

        return getattr(torch, name)
    if module in ("jax", "jaxlib"):
        import jax.numpy as jnp

        return getattr(jnp, name)
    if "strict" in xp.__name__:
        raise TypeError(f"array-api-strict has no {name} dtype")
    # numpy-backed namespaces (numpy, dask, cupy) use numpy dtype objects
    if name != "bfloat16":
        import numpy as np

        return np.dtype(name)
    try:
        import ml_dtypes
    except ImportError:  # pragma: no cover - ml_dtypes is a dependency
        raise TypeError(
            f"bfloat16 needs ml_dtypes for the array library {xp.__name__}: pip install ml_dtypes"
        ) from None
    if module == "cupy" and not _cupy_has(ml_dtypes.bfloat16):
        import cupy

        raise TypeError(f"cupy {cupy.__version__} has no bfloat16 dtype (cupy >= 14 has)")
    return ml_dtypes.bfloat16


def _cupy_has(dtype: Any) -> bool:
    """Whether this cupy can allocate arrays of ``dtype`` (bfloat16: cupy >= 14)."""
    import cupy

    try:
        cupy.empty(0, dtype=dtype)
    except (TypeError, ValueError):
        return False
    return True
