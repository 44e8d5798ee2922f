"""A bounded pool of freed output buffers for the CPU backend's allocating calls.

A fresh numpy array of a megabyte or more is fresh memory from the OS: the
kernel's first write to each of its pages faults, and the OS zeroes the page
before the kernel may write it.  For a large forward that is most of another
pass over the output (16384 x 4096 float32: ~12 ms of a ~29 ms call on a
2-core machine).  Handing out a buffer that an earlier output no longer needs
skips both, as ONNX Runtime's arena and cupy's memory pool do.

A buffer comes back only when nothing can reach the array it backed: the
array's ``base`` is a small lease object, and the buffer returns to the pool
when the lease is collected, after the array and every view of it (a torch
tensor made by ``torch.from_numpy`` holds the array too).  So a result is
never shared with a later one.  Sizes are rounded up to one of 16-32 classes
per doubling (at most ~6% more memory), so that near sizes share buffers.
What the pool keeps is bounded by :attr:`OutputPool.max_bytes`: a returning
buffer makes room by freeing the size classes returned to least recently, so
a pool that saw other sizes before follows the sizes in use now.

Arrays from the pool are ordinary numpy arrays, with two differences from
``np.empty``: they do not own their memory (``a.flags.owndata`` is False,
so ``a.resize`` refuses), and they start on a page boundary.
"""

from __future__ import annotations

import math
import os
import threading
from typing import Any

import numpy as np

__all__ = ["MIN_BYTES", "OutputPool", "output_pool"]

#: Outputs below this many bytes come from ``np.empty``: the allocator reuses
#: small blocks without the OS, and a pool lookup would cost more than it saves.
MIN_BYTES = 1 << 20
#: Pooled sizes are whole multiples of this at least (and of 1/32 of the size).
GRAIN = 1 << 16
#: Pooled arrays start on a page.  Where an output starts a little after
#: its inputs within a 4 KiB page (numpy's large arrays start 16 bytes in),
#: each store looks to the core like it may alias a later load of the inputs
#: (addresses compared modulo 4 KiB), and the loads wait: the float16
#: backward ran 1.3x slower into an output 64 bytes into its page than into
#: one at 0, 16 or 2048 bytes.
ALIGN = 4096


def _default_max_bytes() -> int:
    env = os.environ.get("POLYNORM_OUTPUT_POOL_BYTES")
    if env is not None:
        try:
            return max(0, int(env))
        except ValueError:
            raise ValueError(
                f"POLYNORM_OUTPUT_POOL_BYTES must be a whole number of bytes, got {env!r}"
            ) from None
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        ram = 8 << 30
    return min(1 << 30, ram // 8)


class _Lease:
    """The ``base`` of a pooled array: returns the buffer when collected."""

    __slots__ = ("__array_interface__", "_pool", "_raw", "_ptr", "_size")

    def __init__(self, pool: OutputPool, raw: np.ndarray, ptr: int, size: int):
        # bytes: the caller views them as its dtype (one numpy does not name, too)
        self.__array_interface__ = {"shape": (size,), "typestr": "|u1",
                                    "data": (ptr, False), "version": 3}
        self._pool, self._raw, self._ptr, self._size = pool, raw, ptr, size

    def __del__(self) -> None:
        try:
            self._pool._give_back(self._raw, self._ptr, self._size)
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


class OutputPool:
    """Freed output buffers of the CPU backend, kept for its next allocating calls.

    Parameters
    ----------
    max_bytes : int
        The most the pool keeps while no array uses it; 0 turns it off.  The
        default, ``polynorm.output_pool``, keeps up to 1 GiB (an eighth of
        the machine's memory where that is less), or the environment variable
        ``POLYNORM_OUTPUT_POOL_BYTES``.

    Examples
    --------
    >>> import numpy as np
    >>> pool = OutputPool(64 << 20)
    >>> a = pool.empty((1024, 1024), np.float32)
    >>> address = a.ctypes.data
    >>> del a
    >>> pool.held_bytes
    4194304
    >>> pool.empty((1024, 1024), np.float32).ctypes.data == address
    True
    >>> pool.clear(); pool.held_bytes
    0
    """

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._free: dict[int, list[tuple[np.ndarray, int]]] = {}
        self._held = 0
        # reentrant: a lease collected while this thread holds the lock comes back
        self._lock = threading.RLock()

    @property
    def max_bytes(self) -> int:
        """The most the pool keeps while no array uses it (0: off); setting it
        lower frees what is above."""
        return self._max

    @max_bytes.setter
    def max_bytes(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
            raise ValueError(f"max_bytes must be a whole number >= 0, got {value!r}")
        self._max = int(value)
        if getattr(self, "_free", None) is not None:
            self._trim(self._max)

    @property
    def held_bytes(self) -> int:
        """Bytes the pool keeps now (buffers no array uses)."""
        return self._held

    def clear(self) -> None:
        """Free every buffer the pool keeps (arrays in use are not affected)."""
        self._trim(0)

    def empty(self, shape: int | tuple[int, ...], dtype: Any) -> np.ndarray:
        """An uninitialised C-ordered array, from the pool where it is large enough."""
        dt = np.dtype(dtype)
        shape = (shape,) if isinstance(shape, int | np.integer) else tuple(shape)
        nbytes = math.prod(shape) * dt.itemsize
        if nbytes < MIN_BYTES or self._max == 0:
            return np.empty(shape, dt)
        grain = max(GRAIN, 1 << (nbytes.bit_length() - 5))
        size = -(-nbytes // grain) * grain
        with self._lock:
            blocks = self._free.get(size)
            got = blocks.pop() if blocks else None
            if got is not None:
                self._held -= size
                if not blocks:  # _trim takes the first class as non-empty
                    del self._free[size]
        if got is None:
            raw = np.empty(size + ALIGN, np.uint8)
            base = raw.__array_interface__["data"][0]
            got = (raw, base + (-base) % ALIGN)
        return np.ndarray(shape, dt, np.asarray(_Lease(self, got[0], got[1], size)))

    def _give_back(self, raw: np.ndarray, ptr: int, size: int) -> None:
        with self._lock:
            if size > self._max:
                return
            # the dict's order is the classes' order of last return: this one last
            blocks = self._free.pop(size, [])
            blocks.append((raw, ptr))
            self._free[size] = blocks
            self._held += size
            self._trim(self._max)

    def _trim(self, limit: int) -> None:
        """Free buffers, least recently returned class first, until at most ``limit``
        bytes are kept."""
        with self._lock:
            while self._held > limit:
                size = next(iter(self._free))
                blocks = self._free[size]
                blocks.pop()
                self._held -= size
                if not blocks:
                    del self._free[size]

    def _after_fork(self) -> None:
        self._lock = threading.RLock()


#: The pool of the Numba backend's outputs (see :class:`OutputPool`).
output_pool = OutputPool(_default_max_bytes())

if hasattr(os, "register_at_fork"):
    # a lock held by another thread at fork() would stay held in the child
    os.register_at_fork(after_in_child=output_pool._after_fork)
