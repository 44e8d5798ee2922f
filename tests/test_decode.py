"""The decode path (polynorm.ops.fast): small numpy forwards cached per call signature.

Each call is made twice through the decode path (the first prepares the
signature's entry, the second runs the kernel's compiled entry point) and
compared bit for bit with the generic front end (``axis=(1,)``), which never
takes it.  The cache-key tests change one thing at a time -- dtype, strides,
options, out -- after a cached call and check that the result (or error) is
the generic path's, never the cached entry's.
"""

from __future__ import annotations

import decimal

import ml_dtypes
import numpy as np
import pytest

import polynorm as pn

pytest.importorskip("numba")

from polynorm.ops import fast  # noqa: E402

DT = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16,
      "float64": np.float64}
D = 67


def _a(rng, shape, dt):
    return rng.standard_normal(shape).astype(DT[dt])


def _bits(a):
    return a.view(np.uint8)


def _same(a, b):
    a = a if isinstance(a, tuple) else (a,)
    b = b if isinstance(b, tuple) else (b,)
    assert len(a) == len(b)
    for p, q in zip(a, b, strict=True):
        if p is None or q is None:  # dbias without a bias
            assert p is None and q is None
            continue
        assert p.dtype == q.dtype and p.shape == q.shape
        np.testing.assert_array_equal(_bits(np.ascontiguousarray(p)),
                                      _bits(np.ascontiguousarray(q)))


def _call(fn, *args, **kw):
    return getattr(pn, fn)(*args, **kw)


def _entry(x):
    """The decode entry (or None) whose key starts with x's shape, strides, dtype."""
    found = [e for k, e in fast._DECODE.items() if k[1:4] == (x.shape, x.strides, x.dtype)]
    return found[-1] if found else None


@pytest.mark.parametrize("xdt,wdt,rdt,kw", [
    ("float32", "float32", None, {}),
    ("bfloat16", "bfloat16", None, {"return_rstd": True}),
    ("float16", "float16", None, {"offset": 1.0, "bias": "float16"}),
    ("float16", "float32", None, {"partial": 0.5, "eps_mode": "outside"}),
    ("float32", None, None, {"out_dtype": "bfloat16"}),
    ("float64", "float64", None, {"eps": 1e-3}),
    ("float32", "float32", "float32", {}),
    ("bfloat16", "bfloat16", "float32", {"return_rstd": True}),
    ("float16", "float16", "float16", {"bias": "bfloat16"}),
], ids=["f32", "bf16-rstd", "f16-bias-offset", "f16-f32w-partial", "f32-noweight-bf16out",
        "f64", "add-f32", "add-bf16-f32r", "add-f16-bf16bias"])
@pytest.mark.parametrize("n,with_out", [(1, False), (5, True)], ids=["1-token", "5-tokens-out"])
def test_decode_bits_equal_generic(xdt, wdt, rdt, kw, n, with_out, rng):
    kw = dict(kw)
    x = _a(rng, (n, D), xdt)
    w = None if wdt is None else _a(rng, D, wdt)
    if "bias" in kw:
        kw["bias"] = _a(rng, D, kw["bias"])
    fn, args = ("rms_norm", (x, w)) if rdt is None else ("add_rms_norm", (x, _a(rng, (n, D), rdt), w))
    want = _call(fn, *args, axis=(1,), **kw)
    y0 = want[0] if isinstance(want, tuple) else want
    for _ in range(2):
        out = np.full_like(y0, 7) if with_out else None
        got = _call(fn, *args, out=out, **kw)
        _same(got, want)
        if with_out:
            assert (got[0] if isinstance(got, tuple) else got) is out
    e = _entry(x)
    assert e is not None and e.entry  # the second call ran the compiled entry point


def test_decode_reads_the_weight_each_call(rng):
    """A weight changed in place between calls is read anew (16-bit: widened anew)."""
    x = _a(rng, (2, D), "float16")
    w = _a(rng, D, "float16")
    pn.rms_norm(x, w)
    w *= 2
    _same(pn.rms_norm(x, w), pn.rms_norm(x, w, axis=(1,)))


def test_decode_read_only_and_misaligned_arrays(rng):
    """Read-only arrays of a signature take its entry point (the lean call, no kernel
    specialisation of their own), from its first calls on; misaligned ones the
    dispatcher; same bits."""
    x = _a(rng, (3, D), "float32")
    w = _a(rng, D, "float32")
    ro = x.copy()
    ro.flags.writeable = False
    wro = w.copy()
    wro.flags.writeable = False
    pn.rms_norm(ro, wro)
    pn.rms_norm(ro, wro)  # cached, entry point resolved
    e = _entry(x)
    kernels = len(e.kernel.overloads)
    y = e.lean(ro, wro, None, False)
    assert y is not None and len(e.kernel.overloads) == kernels
    _same(y, pn.rms_norm(x, w, axis=(1,)))
    _same(pn.rms_norm(ro, wro), pn.rms_norm(x, w, axis=(1,)))
    assert not ro.flags.writeable and not wro.flags.writeable
    raw = np.zeros(x.nbytes + 4, np.uint8)[1:1 + x.nbytes]  # misaligned float32 rows
    mis = raw.view(np.float32).reshape(x.shape)
    mis[...] = x
    assert not mis.flags.aligned
    _same(pn.rms_norm(mis, w), pn.rms_norm(x, w, axis=(1,)))
    out = np.empty_like(x)
    pn.rms_norm(x, w, out=out)
    pn.rms_norm(x, w, out=out)  # cached with an aligned out
    mout = np.zeros(x.nbytes + 4, np.uint8)[2:2 + x.nbytes].view(np.float32).reshape(x.shape)
    assert not mout.flags.aligned
    assert pn.rms_norm(x, w, out=mout) is mout
    _same(mout, pn.rms_norm(x, w, axis=(1,)))


@pytest.mark.parametrize("dt", ["float32", "bfloat16"])
def test_decode_add_takes_read_only_inputs_as_they_are(dt, rng):
    """Read-only x, residual and weight (from a signature's first call on) go to the
    fused add's entry point (no kernel specialisation of their own), with the writable
    arrays' bits, unchanged."""
    fast._DECODE.clear()  # this signature's entry made here (_entry: the last one of x's)
    x, r, w = _a(rng, (2, D), dt), _a(rng, (2, D), dt), _a(rng, D, dt)
    want = pn.add_rms_norm(x, r, w, axis=(1,))
    ro = [a.copy() for a in (x, r, w)]
    for a in ro:
        a.flags.writeable = False
    for _ in range(3):  # prepare, resolve the entry point, then call it
        pn.add_rms_norm(*ro)
    e = _entry(x)
    assert e is not None and e.entry
    kernel, e.kernel = e.kernel, None  # calling the dispatcher would raise
    try:
        got = pn.add_rms_norm(*ro)
    finally:
        e.kernel = kernel
    for g, v in zip(got, want, strict=True):
        _same(g, v)
    for a, b in zip(ro, (x, r, w), strict=True):
        _same(a, b)


@pytest.mark.parametrize("xdt,wdt", [("bfloat16", "bfloat16"), ("float32", "float16")])
def test_decode_lean_call_of_read_only_16_bit_arrays(xdt, wdt, rng):
    """A read-only 16-bit weight (safetensors' arrays) from a signature's first call on:
    its widening's entry point is found, and the lean call takes it."""
    fast._DECODE.clear()  # this signature's entry made here (_entry: the last one of x's)
    x, w = _a(rng, (1, D), xdt), _a(rng, D, wdt)
    want = pn.rms_norm(x, w, axis=(1,))
    for a in (x, w):
        a.flags.writeable = False
    for _ in range(3):
        _same(pn.rms_norm(x, w), want)
    e = _entry(x)
    assert e is not None and e.entry and e.wide
    y = e.lean(x, w, None, False)
    assert y is not None
    _same(y, want)


@pytest.mark.parametrize("xdt,wdt", [("float16", "float16"), ("bfloat16", "bfloat16"),
                                     ("float32", "float16")])
def test_decode_lean_widened_weight(xdt, wdt, rng):
    """The lean call (the weight widened by its entry point into a pooled buffer; the 16-bit
    arrays passed as themselves where x and weight share a format) gives the generic
    path's bits, reads a weight changed in place anew, takes a read-only weight as it
    is, and leaves a misaligned weight to the general decode call."""
    x = _a(rng, (1, D), xdt)
    w = _a(rng, D, wdt)
    out = np.empty_like(x)
    for _ in range(3):  # prepare, resolve the entry points, then the lean call
        assert pn.rms_norm(x, w, out=out) is out
    e = _entry(x)
    assert e is not None and e.lean is not None and e.wide and e.wpool
    # one 16-bit format throughout: the entry points take the arrays themselves, no views
    assert e.raw == (xdt == wdt)
    out[...] = 7
    assert e.lean(x, w, out, False) is out
    _same(out, pn.rms_norm(x, w, axis=(1,)))
    w *= 3
    _same(pn.rms_norm(x, w, out=out), pn.rms_norm(x, w, axis=(1,)))
    wro = w.copy()
    wro.flags.writeable = False
    out[...] = 7
    assert e.lean(x, wro, out, False) is out  # a read-only weight: the entry points too
    _same(out, pn.rms_norm(x, w, axis=(1,)))
    _same(pn.rms_norm(x, wro, out=out), pn.rms_norm(x, w, axis=(1,)))
    raw = np.zeros(w.nbytes + 1, np.uint8)[1:].view(w.dtype)  # misaligned 16-bit weight
    raw[...] = w
    assert e.lean(x, raw, out, False) is None or raw.flags.aligned
    _same(pn.rms_norm(x, raw, out=out), pn.rms_norm(x, w, axis=(1,)))


@pytest.mark.parametrize("dt", ["float32", "float16"])
def test_prepared_call_skips_the_front_end(dt, rng, monkeypatch):
    """A prepared signature's rms_norm runs its lean call at once (ops.norm.forward is not
    called) with the generic path's bits; what the signature does not prove goes on."""
    from polynorm.ops import norm

    x, w = _a(rng, (1, D), dt), _a(rng, D, dt)
    out = np.empty_like(x)
    want = pn.rms_norm(x, w, axis=(1,), return_rstd=True)
    for _ in range(3):
        pn.rms_norm(x, w, out=out)
        pn.rms_norm(x, w, return_rstd=True)

    def front_end(*args, **kwargs):
        raise AssertionError("front end")

    monkeypatch.setattr(norm, "forward", front_end)
    out[...] = 7
    assert pn.rms_norm(x, w, out=out) is out
    _same(out, want[0])
    _same(pn.rms_norm(x, w, return_rstd=True), want)
    ro = out.copy()
    ro.flags.writeable = False
    for call in (lambda: pn.rms_norm(x, w, out=ro), lambda: pn.rms_norm(x, w, out=x[:, ::-1]),
                 lambda: pn.rms_norm(x, w.astype(np.float64)), lambda: pn.rms_norm(x, w, eps=1)):
        with pytest.raises(AssertionError, match="front end"):
            call()


@pytest.mark.parametrize("dt,wdt", [("float32", "float32"), ("float16", "float16"),
                                    ("float32", None)])
def test_inplace_decode_bits_equal_generic(dt, wdt, rng):
    """add_rms_norm_ at decode size (its signature's prepared entry) writes add_rms_norm's
    bits, y over x and h over the residual; arrays not proved apart take the general path."""
    x0, r0 = _a(rng, (2, D), dt), _a(rng, (2, D), dt)
    w = None if wdt is None else _a(rng, D, wdt)
    want = pn.add_rms_norm(x0, r0, w, axis=(1,))
    for _ in range(3):  # prepare, resolve the entry points, then the entry point
        x, r = x0.copy(), r0.copy()
        got = pn.add_rms_norm_(x, r, w)
        assert got[0] is x and got[1] is r
        _same((x, r), want)
    found = [e for k, e in fast._DECODE.items()
             if k[0] == "inplace" and k[2:5] == (x.shape, x.strides, x.dtype)]
    assert found and found[-1] is not None and found[-1].entry
    assert found[-1].raw == (dt == "float16")
    both = np.concatenate([x0, r0])  # views of one array: the general path's checks
    x, r = both[:2], both[2:]
    pn.add_rms_norm_(x, r, w)
    _same((x, r), want)
    with pytest.raises(ValueError, match="overlap"):
        pn.add_rms_norm_(x, x, w)


def test_cache_key_dtype_and_strides(rng):
    """Calls that differ from a cached one only in dtype or strides get their own result."""
    base = _a(rng, (4, 2 * D), "float32")
    w = _a(rng, D, "float32")
    x = np.ascontiguousarray(base[:, :D])
    pn.rms_norm(x, w)
    pn.rms_norm(x, w)
    padded = base[:, :D]  # the same shape and dtype, another row stride
    _same(pn.rms_norm(padded, w), pn.rms_norm(padded, w, axis=(1,)))
    cols = base[:, ::2][:, :D]  # unit stride lost: the general fast path's copy
    _same(pn.rms_norm(cols, w), pn.rms_norm(cols, w, axis=(1,)))
    for dt in ("float16", "bfloat16", "float64"):
        xd = x.astype(DT[dt])
        got = pn.rms_norm(xd, w)
        assert got.dtype == xd.dtype
        _same(got, pn.rms_norm(xd, w, axis=(1,)))
    wd = w.astype(np.float16)  # weight dtype only
    _same(pn.rms_norm(x, wd), pn.rms_norm(x, wd, axis=(1,)))


def test_cache_key_options(rng):
    """Options equal by value but of other types are checked, not matched to the entry."""
    x = _a(rng, (2, D), "float32")
    w = _a(rng, D, "float32")
    for eps in (1e-5, 1e-3):
        pn.rms_norm(x, w, eps=eps)
        pn.rms_norm(x, w, eps=eps)
        _same(pn.rms_norm(x, w, eps=eps), pn.rms_norm(x, w, eps=eps, axis=(1,)))
    pn.rms_norm(x, w, eps=1)
    pn.rms_norm(x, w, eps=1)  # cached with an int eps
    for bad in (True, decimal.Decimal(1)):
        with pytest.raises(TypeError, match="eps") as fast_err:
            pn.rms_norm(x, w, eps=bad)
        with pytest.raises(TypeError) as gen_err:
            pn.rms_norm(x, w, eps=bad, axis=(1,))
        assert str(fast_err.value) == str(gen_err.value)
    pn.rms_norm(x, w, partial=1)
    with pytest.raises(TypeError, match="partial"):
        pn.rms_norm(x, w, partial=True)
    # an unhashable option value: the general path's error
    with pytest.raises(TypeError, match="eps"):
        pn.rms_norm(x, w, eps=np.array([1e-6]))


def test_cache_key_out(rng):
    """out= of a cached signature: overlap, read-only and dtype errors as the generic path's."""
    x = _a(rng, (3, D), "float32")
    w = _a(rng, D, "float32")
    out = np.empty_like(x)
    pn.rms_norm(x, w, out=out)
    pn.rms_norm(x, w, out=out)
    ro = np.empty_like(x)
    ro.flags.writeable = False
    for bad, exc in ((ro, ValueError), (out.astype(np.float16), TypeError)):
        with pytest.raises(exc) as fast_err:
            pn.rms_norm(x, w, out=bad)
        with pytest.raises(exc) as gen_err:
            pn.rms_norm(x, w, out=bad, axis=(1,))
        assert str(fast_err.value) == str(gen_err.value)
    # overlap: out a view of the weight's memory in a cached signature's shape
    big = _a(rng, (4, D), "float32")
    with pytest.raises(ValueError, match="overlaps weight"):
        pn.rms_norm(x, big[2], out=big[:3])
    in_place = x.copy()
    _same(pn.rms_norm(in_place, w, out=in_place), pn.rms_norm(x, w, axis=(1,)))


@pytest.mark.parametrize("dt,gkw", [
    ("float32", {}),
    ("bfloat16", {"norm_before_gate": True, "return_rstd": True}),
    ("float16", {"group_size": 16, "return_rstd": True, "offset": 1.0}),
])
def test_gated_decode_bits_equal_generic(dt, gkw, rng):
    d = 64
    x, z, w = _a(rng, (2, d), dt), _a(rng, (2, d), dt), _a(rng, d, dt)
    want = pn.rms_norm_gated(x, z, w, axis=(1,), **gkw)
    for _ in range(2):
        _same(pn.rms_norm_gated(x, z, w, **gkw), want)
    # the same signature with option values of other types: the general path's answer
    kw = {k: v for k, v in gkw.items() if k != "norm_before_gate"}
    nbg = gkw.get("norm_before_gate", False)
    for other in (int(nbg), np.bool_(nbg)):
        try:
            want = pn.rms_norm_gated(x, z, w, axis=(1,), norm_before_gate=other, **kw)
        except TypeError as exc:
            with pytest.raises(TypeError) as got:
                pn.rms_norm_gated(x, z, w, norm_before_gate=other, **kw)
            assert str(got.value) == str(exc)
        else:
            _same(pn.rms_norm_gated(x, z, w, norm_before_gate=other, **kw), want)
    zf = z.astype(np.float32)  # z's dtype only
    _same(pn.rms_norm_gated(x, zf, w, **gkw), pn.rms_norm_gated(x, zf, w, axis=(1,), **gkw))


@pytest.mark.parametrize("dt,gkw", [
    ("float32", {}),
    ("bfloat16", {"norm_before_gate": True, "return_rstd": True}),
    pytest.param("float16", {"group_size": 16, "offset": 1.0}, marks=pytest.mark.slow),
])
def test_gated_decode_takes_read_only_arrays_through_its_entry_point(dt, gkw, rng,
                                                                     monkeypatch):
    """Read-only x, z and weight (a jax buffer, safetensors' frombuffer), from the
    signature's first call on, go to the gated kernel's compiled entry point as they are
    (no writable alias, no dispatcher), with the writable arrays' bits, unchanged; a
    weight changed in place between calls is read anew."""
    from polynorm.backends import numba as nb
    from polynorm.backends.numba import gated as G

    x, z, w = _a(rng, (2, 64), dt), _a(rng, (2, 64), dt), _a(rng, 64, dt)
    want = pn.rms_norm_gated(x, z, w, axis=(1,), **gkw)
    ro = [a.copy() for a in (x, z, w)]
    for a in ro:
        a.flags.writeable = False
    x_, z_, w_ = ro
    _same(pn.rms_norm_gated(x_, z_, w_, **gkw), want)  # prepares, resolves the entry point

    def refused(*args, **kwargs):
        raise AssertionError("a writable alias or the dispatcher")

    monkeypatch.setattr(nb, "_writable_alias", refused)
    monkeypatch.setattr(G, "forward_rows", refused)
    _same(pn.rms_norm_gated(x_, z_, w_, **gkw), want)
    for a, b in zip(ro, (x, z, w), strict=True):
        _same(a, b)
    monkeypatch.undo()
    w2 = w.copy()  # writable: the same signature, changed in place
    _same(pn.rms_norm_gated(x, z, w2, **gkw), want)
    w2[:] = w2 * 2
    _same(pn.rms_norm_gated(x, z, w2, **gkw), pn.rms_norm_gated(x, z, w2, axis=(1,), **gkw))


@pytest.mark.parametrize("dt,qkw", [
    ("float32", {}),
    ("float32", {"residual": True, "bias": True, "dtype": "int8"}),
    # 16-bit variants of the driver, compiled cold in ~4 s each: the long sweeps
    pytest.param("bfloat16", {"group_size": 16, "scale_mode": "reciprocal"},
                 marks=pytest.mark.slow),
    pytest.param("float16", {"scale": 0.05, "dtype": "float8_e5m2", "partial": 0.5},
                 marks=pytest.mark.slow),
])
def test_quant_decode_bits_equal_generic(dt, qkw, rng):
    """A 2-D numpy quantized call takes its signature's prepared call (QuantDecode; from
    the second call its compiled entry point): the general path's bits (axis=(1,)), new
    arrays on every call (the static scale too), the inputs unchanged."""
    from polynorm.ops import quant as oq

    kw = dict(qkw)
    x, w = _a(rng, (3, 64), dt), _a(rng, 64, dt)
    if kw.pop("residual", False):
        kw["residual"] = _a(rng, (3, 64), dt)
    if kw.pop("bias", False):
        kw["bias"] = _a(rng, 64, dt)
    inputs = [a for a in (x, w, kw.get("residual"), kw.get("bias")) if a is not None]
    before = [a.copy() for a in inputs]
    want = pn.rms_norm_quant(x, w, axis=(1,), **kw)
    oq._DECODE.clear()
    first = pn.rms_norm_quant(x, w, **kw)  # the dispatcher; finds the entry point
    (entry,) = oq._DECODE.values()
    assert entry is not None and entry[2].entry
    got = pn.rms_norm_quant(x, w, **kw)
    _same(first, want)
    _same(got, want)
    for a, b in zip(got, first, strict=True):
        assert not np.shares_memory(a, b)
    for a, b in zip(inputs, before, strict=True):
        _same(a, b)


def test_quant_decode_refuses_what_the_general_path_refuses(rng):
    """A cached signature does not take an argument equal to its key's but of another type:
    ``scale=True`` and ``group_size=True`` raise the general path's TypeError."""
    x, w = _a(rng, (1, 64), "float32"), _a(rng, 64, "float32")
    pn.rms_norm_quant(x, w, scale=1)
    pn.rms_norm_quant(x, w, group_size=1)
    with pytest.raises(TypeError, match="scale"):
        pn.rms_norm_quant(x, w, scale=True)
    with pytest.raises(TypeError, match="group_size"):
        pn.rms_norm_quant(x, w, group_size=True)


@pytest.mark.parametrize("dt,qkw", [
    ("float32", {"residual": True}),
    ("bfloat16", {"group_size": 16}),
])
def test_quant_takes_read_only_arrays_through_its_entry_point(dt, qkw, rng, monkeypatch):
    """Read-only x, residual and weight, from the first read-only call of their types on, go
    to the quantized driver's compiled entry point as they are (no writable alias, no
    dispatcher), with the writable arrays' bits, unchanged."""
    from polynorm.backends import numba as nb
    from polynorm.backends.numba import quant as Q

    qkw = dict(qkw)
    x, w = _a(rng, (2, 64), dt), _a(rng, 64, dt)
    if qkw.pop("residual", False):
        qkw["residual"] = _a(rng, (2, 64), dt)
    want = pn.rms_norm_quant(x, w, **qkw)
    ro = {k: v.copy() for k, v in (("x", x), ("weight", w), *qkw.items())
          if isinstance(v, np.ndarray)}
    for a in ro.values():
        a.flags.writeable = False
    kw = {**qkw, **{k: v for k, v in ro.items() if k not in ("x", "weight")}}
    _same(pn.rms_norm_quant(ro["x"], ro["weight"], **kw), want)  # finds the entry point

    def refused(*args, **kwargs):
        raise AssertionError("a writable alias or the dispatcher")

    monkeypatch.setattr(nb, "_writable_alias", refused)
    monkeypatch.setattr(Q, "quant_rows", refused)
    _same(pn.rms_norm_quant(ro["x"], ro["weight"], **kw), want)
    _same(ro["x"], x)
    _same(ro["weight"], w)


@pytest.mark.parametrize("dt,wdt,kw", [
    ("float32", "float32", {}),
    ("bfloat16", "bfloat16", {"bias": True, "grad_residual": True}),
    ("float16", "float16", {"partial": 0.5, "no_rstd": True}),
    ("float16", None, {}),
])
def test_backward_decode_bits_equal_generic(dt, wdt, kw, rng):
    kw = dict(kw)
    n = 3
    x, dy = _a(rng, (n, D), dt), _a(rng, (n, D), dt)
    w = None if wdt is None else _a(rng, D, wdt)
    if kw.pop("bias", False):
        kw["bias"] = _a(rng, D, dt)
    if kw.get("grad_residual"):
        kw["grad_residual"] = _a(rng, (n, D), dt)
    if not kw.pop("no_rstd", False):
        kw["rstd"] = pn.rms_norm(x, w, return_rstd=True, partial=kw.get("partial", 1.0))[1]
    want = pn.rms_norm_backward(dy, x, w, axis=(1,), **kw)
    for _ in range(3):  # prepare (the dispatcher), then its compiled entry point
        _same(pn.rms_norm_backward(dy, x, w, **kw), want)
    # the same signature, eps of another type: the general path's answer (an error)
    with pytest.raises(TypeError, match="eps"):
        pn.rms_norm_backward(dy, x, w, eps=True, **kw)


@pytest.mark.parametrize("dt", ["float32", "bfloat16"])
def test_backward_decode_takes_read_only_arrays_through_its_entry_point(dt, rng, monkeypatch):
    """Read-only dy, x, weight, rstd and grad_residual (from the signature's first call
    on) go to the backward kernel's compiled entry point as they are, with the writable
    arrays' bits, unchanged."""
    from polynorm.backends import numba as nb

    x, dy, gr = (_a(rng, (2, D), dt) for _ in range(3))
    w = _a(rng, D, dt)
    rstd = pn.rms_norm(x, w, return_rstd=True)[1]
    want = pn.rms_norm_backward(dy, x, w, rstd=rstd, grad_residual=gr, axis=(1,))
    ro = [a.copy() for a in (dy, x, w, rstd, gr)]
    for a in ro:
        a.flags.writeable = False
    dy_, x_, w_, r_, g_ = ro
    for _ in range(2):  # prepare, then resolve the entry point
        pn.rms_norm_backward(dy_, x_, w_, rstd=r_, grad_residual=g_)

    def dispatcher(*args):
        raise AssertionError("the dispatcher or a writable alias ran")

    monkeypatch.setattr(nb, "_bwd_call", dispatcher)
    monkeypatch.setattr(nb, "_writable_alias", dispatcher)  # a 16-bit weight's widening too
    got = pn.rms_norm_backward(dy_, x_, w_, rstd=r_, grad_residual=g_)
    for g, v in zip(got, want, strict=True):
        _same(g, v)
    for a, b in zip(ro, (dy, x, w, rstd, gr), strict=True):
        _same(a, b)


def test_pack_options_eps_cache():
    """eps-only Options are shared per non-zero float eps, never across types or zeros."""
    from polynorm.core import options as o

    a = o.pack_options("rms_norm", {"eps": 1e-5})
    assert o.pack_options("rms_norm", {"eps": 1e-5}) is a and a.eps == 1e-5
    t = o.pack_options("rms_norm", {"eps": True})
    assert t.eps is True and o.pack_options("rms_norm", {"eps": 1.0}).eps.__class__ is float
    assert o.pack_options("rms_norm", {"eps": -0.0}).eps.hex() == "-0x0.0p+0"
    n = len(o._EPS_OPTIONS)
    assert o.pack_options("rms_norm", {"eps": float("nan")}).eps != 0
    assert len(o._EPS_OPTIONS) == n
