"""Where polynorm keeps compiled code: one cache directory, outside the package.

Numba's own default writes its cache into ``__pycache__`` beside the installed
module (a site-packages folder that may be read-only or shared), and keys each
entry on the timestamp of the one file that defines the function, so an edit to
a helper in another module leaves a stale kernel.  polynorm's kernels are
cached under :func:`cache_dir` instead, keyed on every kernel source file.

The directory is ``$POLYNORM_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/polynorm``,
else ``~/.cache/polynorm``.  ``NUMBA_CACHE_DIR``, when the user sets it, wins for
the Numba kernels (Numba's own rule).  ``polynorm warmup`` fills the cache.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir", "install_numba_locator"]

_PACKAGE = Path(__file__).resolve().parent.parent
#: the files whose code the Numba kernels are compiled from
_KERNEL_SOURCES = ("numba/*.py", "rowtree.py")


def cache_dir() -> Path:
    """The root of polynorm's on-disk caches (Numba kernels, CUDA cubins).

    Returns
    -------
    pathlib.Path
        ``$POLYNORM_CACHE_DIR``, else ``$XDG_CACHE_HOME/polynorm``, else
        ``~/.cache/polynorm``; it need not exist yet.

    Examples
    --------
    >>> import os
    >>> from polynorm.core.cache import cache_dir
    >>> os.environ.get("POLYNORM_CACHE_DIR") is not None or cache_dir().name == "polynorm"
    True
    """
    root = os.environ.get("POLYNORM_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "polynorm"


def _kernel_stamp() -> tuple:
    """(mtime, size) of every kernel source: any edit invalidates every cached kernel."""
    files = sorted({p for pat in _KERNEL_SOURCES for p in (_PACKAGE / "backends").glob(pat)})
    stamp = []
    for p in files:
        st = p.stat()
        stamp.append((p.relative_to(_PACKAGE).as_posix(), st.st_mtime, st.st_size))
    return tuple(stamp)


_installed = False


def install_numba_locator() -> None:
    """Send the on-disk cache of polynorm's Numba kernels to :func:`cache_dir`.

    Adds a cache locator in front of Numba's own that answers only for files of
    this package (other Numba code keeps Numba's rules) and only when the user
    has not set ``NUMBA_CACHE_DIR``.  Idempotent; a Numba without the locator
    machinery keeps its default.
    """
    global _installed
    if _installed:
        return
    _installed = True
    try:
        from numba.core import caching
    except ImportError:  # pragma: no cover - numba is what calls this
        return
    base = getattr(caching, "UserProvidedCacheLocator", None) or getattr(
        caching, "_UserProvidedCacheLocator", None
    )
    impl = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl", None)
    if base is None or impl is None or not hasattr(impl, "_locator_classes"):
        return  # pragma: no cover - an older or newer Numba: its default place

    class PolynormCacheLocator(base):  # type: ignore[valid-type,misc]
        """Numba kernels of this package, cached under ``cache_dir()/numba``."""

        def __init__(self, py_func, py_file):
            self._py_file = py_file
            self._lineno = py_func.__code__.co_firstlineno
            sub = self.get_suitable_cache_subpath(py_file)
            self._cache_path = str(cache_dir() / "numba" / sub)

        def get_source_stamp(self):
            return _kernel_stamp()

        @classmethod
        def from_function(cls, py_func, py_file):
            if os.environ.get("NUMBA_CACHE_DIR"):
                return None
            try:
                inside = Path(py_file).resolve().is_relative_to(_PACKAGE)
            except (OSError, ValueError):
                return None
            if not inside or not os.path.exists(py_file):
                return None
            self = cls(py_func, py_file)
            try:
                self.ensure_cache_path()
            except OSError:
                return None  # not writable: the next locator (or no cache) decides
            return self

    impl._locator_classes.insert(0, PolynormCacheLocator)
