"""The hidden axis split across ranks with torch.distributed: ``polynorm.torch.distributed``
and DTensor inputs of ``polynorm.torch.rms_norm``, on 2 gloo processes (CPU).

One spawn of two processes runs every check (a process start and torch's import cost
seconds each); the store is a FileStore in ``tmp_path`` (no port).  Expected values are
the RMSNorm formula written with torch operations in float64, differentiated by torch's
autograd on the whole (unsplit) tensor.  The workers run the array-API reference
(``backend="array_api"``): what is tested here is the communication, and a fresh
process's first Numba call costs seconds (the kernels are tested in test_split.py).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

EPS = 0.05
WORLD = 2


def _formula(x, w, b):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w + b


def _reference(x, w, b, g):
    xr, wr, br = (t.detach().clone().double().requires_grad_() for t in (x, w, b))
    y = _formula(xr, wr, br)
    (y * g.double()).sum().backward()
    return y.detach(), xr.grad, wr.grad, br.grad


def _close(got, want, what, tol):
    torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol, msg=what)


def _check_split(rank):
    from polynorm.torch.distributed import rms_norm

    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 2e-5)):
        gen = torch.Generator().manual_seed(0)
        x, g = (torch.randn(5, 12, generator=gen, dtype=dtype) for _ in range(2))
        w, b = (torch.randn(12, generator=gen, dtype=dtype) for _ in range(2))
        y_ref, dx_ref, dw_ref, db_ref = _reference(x, w, b, g)
        cols = slice(rank * 6, rank * 6 + 6)
        xl, wl, bl = (t[..., cols].clone().requires_grad_() for t in (x, w, b))
        y = rms_norm(xl, wl, bl, eps=EPS, backend="array_api")
        assert y.dtype == dtype and y.shape == (5, 6)
        (y * g[:, cols]).sum().backward()
        _close(y, y_ref[:, cols], f"y {dtype}", tol)
        _close(xl.grad, dx_ref[:, cols], f"dx {dtype}", tol)
        _close(wl.grad, dw_ref[cols], f"dweight {dtype}", tol)
        _close(bl.grad, db_ref[cols], f"dbias {dtype}", tol)


def _check_dtensor(rank):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    from polynorm.torch import rms_norm

    mesh = init_device_mesh("cpu", (WORLD,))
    gen = torch.Generator().manual_seed(1)
    x, g = (torch.randn(5, 12, generator=gen, dtype=torch.float64) for _ in range(2))
    w, b = (torch.randn(12, generator=gen, dtype=torch.float64) for _ in range(2))
    y_ref, dx_ref, dw_ref, db_ref = _reference(x, w, b, g)
    for placement in (Shard(0), Shard(1), Replicate()):
        for plain_weight in (False, True):
            xd = torch.nn.Parameter(distribute_tensor(x, mesh, [placement]))
            if plain_weight:
                wd, bd = (torch.nn.Parameter(t.clone()) for t in (w, b))
            else:
                wd, bd = (torch.nn.Parameter(distribute_tensor(t, mesh, [Replicate()]))
                          for t in (w, b))
            y = rms_norm(xd, wd, bd, eps=EPS, backend="array_api")
            what = f"{placement} plain weight={plain_weight}"
            assert type(y).__name__ == "DTensor" and tuple(y.placements) == (placement,), what
            (y * distribute_tensor(g, mesh, [placement])).sum().backward()
            _close(y.full_tensor(), y_ref, "y " + what, 1e-12)
            _close(xd.grad.full_tensor(), dx_ref, "dx " + what, 1e-12)
            if plain_weight:
                # a plain parameter is taken as replicated: its gradient is the whole
                # gradient on every rank
                _close(wd.grad, dw_ref, "dweight " + what, 1e-12)
                _close(bd.grad, db_ref, "dbias " + what, 1e-12)
            else:
                _close(wd.grad.full_tensor(), dw_ref, "dweight " + what, 1e-12)
                _close(bd.grad.full_tensor(), db_ref, "dbias " + what, 1e-12)


def _check_dtensor_add(rank):
    from torch.distributed.tensor import Partial, Shard, distribute_tensor, init_device_mesh

    from polynorm.torch import add_rms_norm, rms_norm

    mesh = init_device_mesh("cpu", (WORLD,))
    gen = torch.Generator().manual_seed(2)
    x, r, g, gh = (torch.randn(4, 10, generator=gen, dtype=torch.float64) for _ in range(4))
    w, b = (torch.randn(10, generator=gen, dtype=torch.float64) for _ in range(2))
    xr, rr = x.clone().requires_grad_(), r.clone().requires_grad_()
    h_ref = xr + rr
    y_ref = _formula(h_ref, w, b)
    ((y_ref * g).sum() + (h_ref * gh).sum()).backward()
    for placement in (Shard(0), Shard(1)):
        xd, rd = (torch.nn.Parameter(distribute_tensor(t, mesh, [placement])) for t in (x, r))
        y, h = add_rms_norm(xd, rd, w, b, eps=EPS, backend="array_api")
        assert tuple(y.placements) == tuple(h.placements) == (placement,)
        ((y * distribute_tensor(g, mesh, [placement])).sum()
         + (h * distribute_tensor(gh, mesh, [placement])).sum()).backward()
        _close(y.full_tensor(), y_ref.detach(), f"add y {placement}", 1e-12)
        _close(h.full_tensor(), h_ref.detach(), f"add h {placement}", 1e-12)
        _close(xd.grad.full_tensor(), xr.grad, f"add dx {placement}", 1e-12)
        _close(rd.grad.full_tensor(), rr.grad, f"add dresidual {placement}", 1e-12)
    partial = distribute_tensor(x, mesh, [Shard(0)]).redistribute(mesh, [Shard(0)])
    partial = type(partial).from_local(partial.to_local(), mesh, [Partial()], run_check=False)
    try:
        rms_norm(partial, eps=EPS)
    except ValueError as exc:
        assert "Partial" in str(exc)
    else:
        raise AssertionError("a Partial DTensor x was not refused")


def _worker(rank, path):
    dist.init_process_group("gloo", store=dist.FileStore(path, WORLD), rank=rank,
                            world_size=WORLD)
    try:
        _check_split(rank)
        _check_dtensor(rank)
        _check_dtensor_add(rank)
        # neither rank tears gloo down while the other still runs a collective: that
        # aborted a worker ("terminate called without an active exception")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_split_hidden_axis_and_dtensor_on_two_gloo_processes(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(str(tmp_path / "store"),), nprocs=WORLD, join=True)
