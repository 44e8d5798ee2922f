"""What every layer shares: the semantics decided once, and the host plumbing.

:mod:`~polynorm.core.options` (``Options`` -> ``Plan``: k, eps placement, casting,
dtypes), :mod:`~polynorm.core.dtypes`, :mod:`~polynorm.core.memory` (``out=``
checks), :mod:`~polynorm.core.interop` (zero-copy views between array libraries),
:mod:`~polynorm.core.pool` (the output pool) and :mod:`~polynorm.core.cache`
(the on-disk kernel cache).  Nothing here imports the front end or a backend.
"""
