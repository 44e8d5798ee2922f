"""Batch invariance (SPEC): a token's y, h, rstd and dx bits are those of the same token
alone in a contiguous (1, d) call, whatever the other tokens, their number, the token's
position, the strides, the memory order or the dask chunks.

Every backend here: the reference on numpy and on array-api-strict, Numba on numpy and
on torch CPU tensors, dask, jax, and the CUDA kernels run by the CPU emulator (few and
small cases: they compile C++).  ``POLYNORM_HYPOTHESIS_EXAMPLES`` raises the example
count (default 25 per backend).
"""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import polynorm as pn

EXAMPLES = int(os.environ.get("POLYNORM_HYPOTHESIS_EXAMPLES", "25"))
NP = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32,
      "float64": np.float64}


def _bits(a) -> np.ndarray:
    a = np.ascontiguousarray(np.asarray(a))
    return a.view(f"u{a.itemsize}")


# ------------------------------------------------------------------ how each backend is called


def _to_numpy(a):
    if a is None:
        return None
    if type(a).__module__.startswith("torch"):
        import torch

        if a.dtype == torch.bfloat16:
            return a.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return a.numpy()
    if type(a).__module__.startswith("dask"):
        return np.asarray(a.compute(scheduler="sync"))
    return np.asarray(a)


def _make(kind: str, a: np.ndarray, chunk_rows: int):
    """``a`` (layout kept where the library can keep it) as the array type of ``kind``."""
    if kind in ("numpy", "numpy_ref"):
        return a
    if kind == "torch":
        import torch

        if any(st_ < 0 for st_ in a.strides):  # torch has no negative strides
            a = np.ascontiguousarray(a)
        if a.dtype == ml_dtypes.bfloat16:  # torch.from_numpy keeps the strides
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(a)
    if kind == "strict":
        xs = pytest.importorskip("array_api_strict")
        return xs.asarray(a)
    if kind == "dask":
        da = pytest.importorskip("dask.array")
        return da.from_array(a, chunks=(chunk_rows,) + a.shape[1:] if a.ndim == 2 else a.shape)
    if kind == "jax":
        jnp = pytest.importorskip("jax.numpy")
        return jnp.asarray(a)
    raise AssertionError(kind)


KINDS = {  # kind -> backend
    "numpy": "auto",  # numba when usable
    "numpy_ref": "array_api",
    "strict": "array_api",
    "torch": "auto",
    "dask": "auto",
    "jax": "auto",
}


def _call(kind, x, r, w, dy, dtype, chunk_rows, opts):
    backend = KINDS[kind]
    mk = lambda a: None if a is None else _make(kind, a, chunk_rows)  # noqa: E731
    if r is None:
        y, rstd = pn.rms_norm(mk(x), mk(w), return_rstd=True, backend=backend, **opts)
        h, hx = None, x
    else:
        y, h, rstd = pn.add_rms_norm(mk(x), mk(r), mk(w), return_rstd=True, backend=backend,
                                     **opts)
        hx = _to_numpy(h)
    dx = pn.rms_norm_backward(mk(dy), mk(hx), mk(w), backend=backend, **opts)[0]
    return [_to_numpy(a) for a in (y, h, rstd, dx)]


def _layout(base: np.ndarray, layout: str) -> np.ndarray:
    """The same values as ``base`` (n, d), held in another layout."""
    n, d = base.shape
    if layout == "padded":  # rows inside a wider buffer
        buf = np.zeros((n, d + 3), base.dtype)
        buf[:, 1:d + 1] = base
        return buf[:, 1:d + 1]
    if layout == "negative":  # rows stored in reverse
        return np.ascontiguousarray(base[::-1])[::-1]
    if layout == "fortran":
        return np.asfortranarray(base)
    return base.copy()


@st.composite
def _cases(draw, dtypes, layouts):
    n = draw(st.integers(1, 6))
    d = draw(st.integers(1, 40))
    dtype = draw(st.sampled_from(dtypes))
    layout = draw(st.sampled_from(layouts))
    pos = draw(st.integers(0, n - 1))
    fused = draw(st.booleans())
    chunk_rows = draw(st.integers(1, n))
    opts = draw(st.sampled_from([{}, {"partial": 0.5}, {"eps_mode": "outside", "eps": 1e-3},
                                 {"offset": 1.0, "casting": "llama"}]))
    seed = draw(st.integers(0, 2**16))
    return n, d, dtype, layout, pos, fused, chunk_rows, opts, seed


def _check_backend(kind, dtypes, layouts):
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(_cases(dtypes, layouts))
    def check(case):
        n, d, dtype, layout, pos, fused, chunk_rows, opts, seed = case
        if kind in ("strict",) and dtype == "bfloat16":
            return
        rng = np.random.default_rng(seed)
        make = lambda: (rng.standard_normal((n, d)) * 3).astype(NP[dtype])  # noqa: E731
        x, r, dy = make(), make() if fused else None, make()
        w = (1 + 0.3 * rng.standard_normal(d)).astype(NP[dtype])
        got = _call(kind, _layout(x, layout), None if r is None else _layout(r, layout), w,
                    _layout(dy, layout), dtype, chunk_rows, opts)
        one = lambda a: None if a is None else np.ascontiguousarray(a[pos:pos + 1])  # noqa: E731
        alone = _call(kind, one(x), one(r), w, one(dy), dtype, 1, opts)
        for what, g, a in zip(("y", "h", "rstd", "dx"), got, alone, strict=True):
            if g is None:
                continue
            assert np.array_equal(_bits(g[pos:pos + 1]), _bits(a)), (
                f"{kind}: {what} of token {pos} of {n} ({layout}, {dtype}, d={d}, {opts}) "
                "differs from the token alone")

    check()


ALL = ("float16", "bfloat16", "float32", "float64")


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_tokens_bits_do_not_depend_on_the_batch(kind):
    if kind in ("numpy", "torch") and not pn.backends()["numba"][0]:
        pytest.skip("numba is not usable here")
    if kind == "torch":
        pytest.importorskip("torch")
    # array-api-strict has no layout control: its numpy sums follow the memory order
    layouts = ["c", "padded", "negative"] + ([] if kind == "strict" else ["fortran"])
    _check_backend(kind, ("float32", "float64") if kind == "strict" else ALL, layouts)


def test_reference_fortran_order_batch_is_batch_invariant():
    x = np.random.default_rng(5).standard_normal((2, 14)).astype(np.float32) * 3
    batch = pn.rms_norm(np.asfortranarray(x), backend="array_api", return_rstd=True)[1]
    alone = [pn.rms_norm(x[i:i + 1].copy(), backend="array_api", return_rstd=True)[1][0]
             for i in range(2)]
    assert np.array_equal(_bits(batch), _bits(np.array(alone, np.float32)))



def test_reference_column_major_torch_batch_is_batch_invariant():
    """torch reduces a strided row in another order than a contiguous one: the reference makes
    the rows contiguous, so a column-major batch gives each token's rstd bits alone."""
    torch = pytest.importorskip("torch")
    x = torch.from_numpy(np.random.default_rng(6).standard_normal((64, 1024)).astype(np.float32))
    batch = pn.rms_norm(x.t().contiguous().t(), backend="array_api", return_rstd=True)[1]
    alone = torch.stack([pn.rms_norm(x[i:i + 1], backend="array_api", return_rstd=True)[1][0]
                         for i in range(64)])
    assert torch.equal(batch.view(torch.int32), alone.view(torch.int32))


# ------------------------------------------------------------------ the emulated CUDA kernels


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_emulated_cuda_kernels_are_batch_invariant(dtype):
    """The cupy backend's kernels on the CPU emulator: each token of a padded-row batch has
    the bits of the same token alone (forward y/h/rstd, backward dx)."""
    emul = pytest.importorskip("test_emul_kernels")
    from polynorm.core.options import Options, make_plan

    try:
        emul.module(dtype)
    except Exception as exc:  # no g++ or the emulator cannot build here
        pytest.skip(f"emulator unavailable: {exc}")
    rng = np.random.default_rng(7)
    n, d = 5, 33
    plan = make_plan(d, dtype, Options())

    def padded(a):
        buf = np.zeros((a.shape[0], d + 7), a.dtype)
        buf[:, 2:d + 2] = a
        return buf[:, 2:d + 2]

    x, r, dy = ((rng.standard_normal((n, d)) * 2).astype(NP[dtype]) for _ in range(3))
    w = (1 + 0.3 * rng.standard_normal(d)).astype(NP[dtype])
    y, h, rstd, _ = emul.emul_forward(padded(x), padded(r), w, None, plan)
    dx = emul.emul_backward(padded(dy), padded(h), w, None, None, None, plan)[0]
    for i in range(n):
        y1, h1, r1, _ = emul.emul_forward(x[i:i + 1].copy(), r[i:i + 1].copy(), w, None, plan)
        dx1 = emul.emul_backward(dy[i:i + 1].copy(), h1, w, None, None, None, plan)[0]
        for what, g, a in (("y", y, y1), ("h", h, h1), ("rstd", rstd, r1), ("dx", dx, dx1)):
            assert np.array_equal(_bits(g[i:i + 1]), _bits(a)), f"{what} of token {i}"
