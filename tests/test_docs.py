"""Every public function is documented (numpydoc) with an example the test run executes.

The examples themselves run through ``--doctest-modules`` (pyproject); this
checks that each public function has one, so a new function cannot slip in
undocumented.
"""

from __future__ import annotations

import doctest
import importlib
import inspect

import pytest

import polynorm as pn

#: Public modules: the package itself, the CLI, and the framework wrappers where present.
MODULES = ["polynorm", "polynorm.cli", "polynorm.torch", "polynorm.jax"]


def _public_functions():
    for modname in MODULES:
        try:
            mod = importlib.import_module(modname)
        except ImportError as exc:  # polynorm.torch without torch, or not written yet
            yield pytest.param(None, None, marks=pytest.mark.skip(reason=f"{modname}: {exc}"),
                               id=modname)
            continue
        names = getattr(mod, "__all__", None) or (["main"] if modname == "polynorm.cli" else [])
        for name in names:
            obj = getattr(mod, name)
            if inspect.isfunction(obj) or inspect.isclass(obj):
                yield pytest.param(modname, obj, id=f"{modname}.{name}")


@pytest.mark.parametrize(("modname", "obj"), list(_public_functions()))
def test_public_function_has_numpydoc_with_an_example(modname, obj):
    doc = inspect.getdoc(obj) or ""
    assert doc, f"{modname}.{obj.__name__} has no docstring"
    assert "Examples\n--------" in doc, f"{modname}.{obj.__name__}: no numpydoc Examples section"
    tests = doctest.DocTestFinder(recurse=False).find(obj, obj.__name__, module=False)
    assert tests and tests[0].examples, f"{modname}.{obj.__name__}: no runnable >>> example"
    if inspect.isfunction(obj) and inspect.signature(obj).parameters:
        assert "Parameters\n----------" in doc or "Returns\n-------" in doc, (
            f"{modname}.{obj.__name__}: no numpydoc Parameters/Returns section"
        )


def test_the_package_exports_what_the_spec_names():
    for name in ("rms_norm", "add_rms_norm", "rms_norm_backward", "backends"):
        assert name in pn.__all__


# ------------------------------------------------------------------ claims the README makes


#: the shapes the README names for its claims about torch and Hugging Face bits
TORCH_SHAPES = [(64, 1024), (64, 16, 4096), (7, 127)]
_INT_VIEW = {2: "int16", 4: "int32", 8: "int64"}


def _ulps(a, b):
    """|a - b| in units in the last place, per element (same dtype, same sign)."""
    torch = pytest.importorskip("torch")
    it = getattr(torch, _INT_VIEW[a.element_size()])
    return (a.view(it).to(torch.int64) - b.view(it).to(torch.int64)).abs()


def _torch_case(shape, dtype, seed):
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    x = torch.randn(*shape, generator=g, dtype=torch.float64).to(dt)
    w = (1 + 0.3 * torch.randn(shape[-1], generator=g, dtype=torch.float64)).to(dt)
    op = torch.float64 if dtype == "float64" else torch.float32
    h = x.to(op)
    r_torch = torch.rsqrt(h.pow(2).mean(-1) + 1e-6)  # torch's statistic, in its opmath dtype
    return x, w, h, r_torch


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float64"])
@pytest.mark.parametrize("shape", TORCH_SHAPES, ids=str)
def test_readme_claim_default_casting_has_torch_rms_norm_bits_where_rstd_agrees(shape, dtype):
    """README: y has F.rms_norm's bits on every token whose rstd is torch's; elsewhere
    rstd is 1-3 ulps off and y one unit of a 16-bit output dtype at most."""
    torch = pytest.importorskip("torch")
    x, w, _, r_torch = _torch_case(shape, dtype, seed=len(shape) + shape[-1])
    for weight in (w, None):
        want = torch.nn.functional.rms_norm(x, (shape[-1],), weight, 1e-6)
        got, rstd = pn.rms_norm(x, weight, eps=1e-6, return_rstd=True)
        assert got.dtype == want.dtype
        same = rstd == r_torch
        assert same.any() and torch.equal(got[same], want[same])
        r_ulps = _ulps(rstd, r_torch).max().item()
        assert r_ulps <= 3
        # 16-bit output: one unit at most; float32/float64 output: a few units per unit of rstd
        allowed = 1 if got.element_size() == 2 else 4 * max(1, r_ulps)
        assert _ulps(got, want).max().item() <= allowed


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("shape", TORCH_SHAPES, ids=str)
def test_readme_claim_llama_casting_has_hugging_face_bits_where_rstd_agrees(shape, dtype):
    torch = pytest.importorskip("torch")
    x, w, h, r_torch = _torch_case(shape, dtype, seed=7 + shape[-1])
    # transformers' LlamaRMSNorm.forward
    want = w * (h * r_torch[..., None]).to(x.dtype)
    got, rstd = pn.rms_norm(x, w, eps=1e-6, casting="llama", return_rstd=True)
    same = rstd == r_torch
    assert same.any() and torch.equal(got[same], want[same])
    allowed = 2 if dtype != "float32" else 4 * max(1, _ulps(rstd, r_torch).max().item())  # two roundings
    assert _ulps(got, want).max().item() <= allowed
    if dtype != "float32":  # the default casting rounds once: often another bit
        default = pn.rms_norm(x, w, eps=1e-6)
        assert (default[same] != want[same]).float().mean() > 0.05


