"""The output pool (polynorm.core.pool): a result's memory is reused only once
nothing can reach it, the pool stays inside its bound, and the Numba
backend's allocating calls draw from it."""

from __future__ import annotations

import multiprocessing
import threading

import numpy as np
import pytest

import polynorm as pn
from polynorm.core import pool as _pool
from polynorm.core.pool import MIN_BYTES, OutputPool

BIG = (64, 8192)  # 2 MiB of float32: pooled
assert BIG[0] * BIG[1] * 4 >= MIN_BYTES


def _address(a) -> int:
    return np.asarray(a).__array_interface__["data"][0]


def _x(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(BIG, dtype=np.float32)


@pytest.fixture
def pool():
    p = OutputPool(64 << 20)
    yield p
    p.clear()


def test_a_freed_buffer_is_reused_and_a_live_one_is_not(pool):
    a = pool.empty(BIG, np.float32)
    b = pool.empty(BIG, np.float32)
    assert not np.shares_memory(a, b)
    where = _address(a)
    del a
    assert pool.held_bytes == BIG[0] * BIG[1] * 4
    c = pool.empty(BIG, np.float32)
    assert _address(c) == where and not np.shares_memory(b, c)
    assert pool.held_bytes == 0


def test_a_view_keeps_its_buffer_out_of_the_pool(pool):
    a = pool.empty(BIG, np.float32)
    a[...] = 7
    v = a[3:, ::2]
    del a
    assert pool.held_bytes == 0
    b = pool.empty(BIG, np.float32)
    b[...] = -1
    assert not np.shares_memory(b, v) and np.all(v == 7)
    del v
    assert pool.held_bytes > 0


def test_arrays_are_page_aligned_writable_c_ordered_of_any_dtype(pool):
    import ml_dtypes

    for dt in (np.float32, np.float16, ml_dtypes.bfloat16, np.float64):
        a = pool.empty((3, 1000, 500), dt)
        assert a.dtype == np.dtype(dt) and a.shape == (3, 1000, 500)
        assert a.flags.c_contiguous and a.flags.writeable and _address(a) % 4096 == 0
    assert pool.empty(BIG[1] * 128, np.float32).shape == (BIG[1] * 128,)


def test_small_arrays_and_a_zero_bound_bypass_the_pool(pool):
    small = pool.empty((4, 4), np.float32)
    assert small.flags.owndata
    pool.max_bytes = 0
    big = pool.empty(BIG, np.float32)
    assert big.flags.owndata
    del big
    assert pool.held_bytes == 0


def test_the_bound_holds_and_lowering_it_frees(pool):
    size = BIG[0] * BIG[1] * 4
    pool.max_bytes = 2 * size
    arrays = [pool.empty(BIG, np.float32) for _ in range(4)]
    del arrays
    assert pool.held_bytes == 2 * size
    pool.max_bytes = size
    assert pool.held_bytes == size
    pool.clear()
    assert pool.held_bytes == 0


def test_the_pool_follows_the_sizes_in_use(pool):
    """A full pool makes room by freeing the least recently returned sizes."""
    mib = 1 << 20
    pool.max_bytes = 8 * mib
    old = [pool.empty(2 * mib, np.uint8) for _ in range(4)]
    del old
    assert pool.held_bytes == 8 * mib
    new = pool.empty(3 * mib, np.uint8)
    new_address = _address(new)
    del new  # frees two of the 2 MiB buffers to make room
    assert pool.held_bytes == 7 * mib
    assert _address(pool.empty(3 * mib, np.uint8)) == new_address
    too_big = pool.empty(9 * mib, np.uint8)
    del too_big  # larger than the bound: freed, nothing else is
    assert pool.held_bytes == 7 * mib


def test_a_class_emptied_by_a_request_is_not_left_behind(pool):
    mib = 1 << 20
    pool.max_bytes = 4 * mib
    a = pool.empty(2 * mib, np.uint8)
    del a
    b = pool.empty(2 * mib, np.uint8)  # takes the class's only buffer
    c, e = pool.empty(3 * mib, np.uint8), pool.empty(3 * mib, np.uint8)
    del c, e  # 6 MiB returned: one 3 MiB buffer is freed to make room
    assert pool.held_bytes == 3 * mib
    del b
    pool.max_bytes = 0
    assert pool.held_bytes == 0


def test_near_sizes_share_a_size_class(pool):
    a = pool.empty(3_000_000, np.uint8)
    where = _address(a)
    del a
    b = pool.empty(1_505_000, np.float16)  # 3_010_000 bytes: the same class (multiples of 2**17 here)
    assert _address(b) == where
    del b
    c = pool.empty(3_200_000, np.uint8)  # the next class up
    assert _address(c) != where


@pytest.mark.parametrize("bad", [-1, 1.5, "1", True, None])
def test_a_bad_bound_is_a_value_error(pool, bad):
    with pytest.raises(ValueError, match="max_bytes"):
        pool.max_bytes = bad


def test_the_environment_variable_sets_the_default(monkeypatch):
    monkeypatch.setenv("POLYNORM_OUTPUT_POOL_BYTES", "12345")
    assert _pool._default_max_bytes() == 12345
    monkeypatch.setenv("POLYNORM_OUTPUT_POOL_BYTES", "1G")
    with pytest.raises(ValueError, match="POLYNORM_OUTPUT_POOL_BYTES"):
        _pool._default_max_bytes()
    monkeypatch.delenv("POLYNORM_OUTPUT_POOL_BYTES")
    assert 0 < _pool._default_max_bytes() <= 1 << 30


def test_threads_never_get_a_buffer_in_use(pool):
    seen: list[str] = []

    def work(k: int) -> None:
        for i in range(50):
            a = pool.empty(BIG, np.float32)
            a[...] = k * 1000 + i
            b = pool.empty(BIG, np.float32)
            b[...] = -1
            if not np.all(a == k * 1000 + i):
                seen.append(f"thread {k} round {i}")

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == []
    assert pool.held_bytes <= pool.max_bytes


# --------------------------------------------------------------------------- the backend


@pytest.fixture
def numba_ready():
    pytest.importorskip("numba")
    from polynorm.backends import numba as nb

    ok, why = nb.available()
    if not ok:
        pytest.skip(why)


@pytest.mark.parametrize("backend", ["auto", "numba"])
def test_results_draw_from_the_pool_and_earlier_ones_survive(numba_ready, backend):
    pn.output_pool.clear()
    x, w = _x(0), np.linspace(0.5, 1.5, BIG[1], dtype=np.float32)
    first = pn.rms_norm(x, w, backend=backend)
    kept = first.copy()
    assert not first.flags.owndata  # from the pool
    where = _address(first)
    second = pn.rms_norm(_x(1), w, backend=backend)
    assert not np.shares_memory(first, second)
    np.testing.assert_array_equal(first, kept)
    del first
    third = pn.rms_norm(x, w, backend=backend)
    assert _address(third) == where  # the freed result's buffer
    np.testing.assert_array_equal(third, kept)  # the same bits as into fresh memory


def test_every_allocating_op_gives_the_bits_of_fresh_memory(numba_ready):
    x, r, dy = _x(0), _x(1), _x(2)
    w = np.linspace(0.5, 1.5, BIG[1], dtype=np.float32)

    def run():
        y = pn.rms_norm(x, w, backend="numba")
        y2, h = pn.add_rms_norm(x, r, w, backend="numba")
        dx, dw, _ = pn.rms_norm_backward(dy, x, w, backend="numba")
        return [a.copy() for a in (y, y2, h, dx, dw)]

    limit = pn.output_pool.max_bytes
    try:
        pn.output_pool.max_bytes = 0
        fresh = run()
        pn.output_pool.max_bytes = 256 << 20
        run()  # fills the pool with buffers holding those results
        garbage = pn.rms_norm(-x, w, backend="numba")  # and one with other values
        del garbage
        pooled = run()
    finally:
        pn.output_pool.max_bytes = limit
    for a, b in zip(fresh, pooled, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_torch_tensor_holds_its_buffer(numba_ready):
    torch = pytest.importorskip("torch")
    pn.output_pool.clear()
    x = torch.from_numpy(_x(0))
    y = pn.rms_norm(x, backend="numba")
    kept = y.clone()
    for seed in range(3):
        other = pn.rms_norm(torch.from_numpy(_x(seed + 1)), backend="numba")
        assert other.data_ptr() != y.data_ptr()
        del other
    assert torch.equal(y, kept)


def _child_allocates(q):
    p = pn.output_pool
    a = p.empty(BIG, np.float32)
    a[...] = 3
    del a
    y = pn.rms_norm(_x(0))
    q.put((p.held_bytes <= p.max_bytes, y.tobytes()))


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(),
                    reason="no fork start method here")
def test_a_forked_child_uses_the_pool(numba_ready, forked):
    held = [pn.output_pool.empty(BIG, np.float32) for _ in range(2)]
    del held  # buffers in the parent's pool at the fork
    code, got = forked(_child_allocates)
    assert code == 0 and got == (True, pn.rms_norm(_x(0)).tobytes())
