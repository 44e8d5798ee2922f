"""The row tree: the one summation order of ``dweight``/``dbias`` over tokens.

The sums over tokens run over a binary tree fixed by the *global* row index,
never by how the rows are split:

- leaf ``(0, g)`` is row ``g``'s term (``dy * xhat`` for dweight, ``dy`` for
  dbias), in the compute dtype;
- node ``(l, j)`` covers rows ``[j * 2**l, (j + 1) * 2**l)`` and is
  ``left + right`` of its children ``(l-1, 2j)`` and ``(l-1, 2j+1)``, or just
  ``left`` when the right child holds no row (beyond the last token);
- nodes below level :data:`TREE_G` (16 rows) are summed in the compute dtype,
  from it up in float64; the root is rounded once to the weight's dtype.

Any partition of the rows into contiguous ranges (threads, row blocks, dask
chunks) computes the same nodes, so every split gives the same bits.  The
Numba kernels (:mod:`.numba.backward_kernels`) compute a range's nodes as they
stream its rows; :func:`merge` joins the node lists of adjacent ranges with
numpy adds, which are the same IEEE adds as the kernel's.

A *state* is the node list of one contiguous range of rows: ``(levels,
indices, values)``, ``values`` of shape ``(nodes, W)`` in float64 (nodes
below :data:`TREE_G` hold compute-dtype values exactly).

Pairwise summation is also the accurate order: the error grows with
``log2(tokens)``, not with the number of tokens.
"""

from __future__ import annotations

import numpy as np

#: Nodes below this level are summed in the compute dtype, the others in float64.
TREE_G = 4

State = tuple[np.ndarray, np.ndarray, np.ndarray]


def empty_state(width: int) -> State:
    """The state of zero rows."""
    return (np.empty(0, np.int64), np.empty(0, np.int64), np.empty((0, width), np.float64))


def _add(a: np.ndarray, b: np.ndarray, level: int, cdt: np.dtype) -> np.ndarray:
    """``a + b`` for a node of ``level``: in the compute dtype below TREE_G."""
    if level < TREE_G:
        return (a.astype(cdt) + b.astype(cdt)).astype(np.float64)
    return a + b


def merge(states: list[State], ntot: int, compute_dtype: np.dtype) -> State:
    """The state of the union of adjacent ranges (given in any order).

    Parameters
    ----------
    states : list of State
        Node lists of ranges that together cover one contiguous range of rows.
    ntot : int
        The number of rows in all (it decides which right children are empty).
    compute_dtype : numpy.dtype
        float32 or float64: the dtype of the adds below :data:`TREE_G`.

    Returns
    -------
    State
        The range's maximal nodes; a single node when the range is all rows.

    Examples
    --------
    >>> import numpy as np
    >>> leaf = lambda g, v: (np.array([0]), np.array([g]), np.array([[v]]))
    >>> lv, idx, val = merge([leaf(2, 3.0), leaf(0, 1.0), leaf(1, 2.0)], 3, np.dtype("float64"))
    >>> lv.tolist(), idx.tolist(), val.tolist()   # (1 + 2) + 3, the root (level 2)
    ([2], [0], [[6.0]])
    """
    nonempty = [s for s in states if s[0].shape[0]]
    if not nonempty:
        return states[0] if states else empty_state(0)
    states = nonempty
    lv = np.concatenate([s[0] for s in states])
    idx = np.concatenate([s[1] for s in states])
    val = np.concatenate([s[2] for s in states])
    order = np.argsort(idx << lv, kind="stable")
    pend: dict[int, tuple[int, np.ndarray]] = {}
    out: list[tuple[int, int, np.ndarray]] = []
    for n in order:
        level, j, v = int(lv[n]), int(idx[n]), val[n]
        while not (j == 0 and (1 << level) >= ntot):  # up to the root
            if j & 1:
                left = pend.get(level)
                if left is None or left[0] != j - 1:
                    break  # the left sibling lies before this range
                del pend[level]
                v = _add(left[1], v, level + 1, compute_dtype)
            elif ((j + 1) << level) < ntot:
                pend[level] = (j, v)
                v = None
                break
            level += 1
            j >>= 1
        if v is not None:
            out.append((level, j, v))
    out += [(level, j, v) for level, (j, v) in pend.items()]
    out.sort(key=lambda node: node[1] << node[0])
    return (np.array([o[0] for o in out], np.int64), np.array([o[1] for o in out], np.int64),
            np.stack([o[2] for o in out]))


def root(state: State, ntot: int) -> np.ndarray:
    """The sum over all ``ntot`` rows: the value of the single node of a full state."""
    lv, idx, val = state
    if lv.shape[0] != 1 or idx[0] != 0 or (1 << int(lv[0])) < ntot:
        raise ValueError("the state does not cover all rows")
    return val[0]
