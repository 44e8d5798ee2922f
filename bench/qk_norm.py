"""QK-norm (+ RoPE) on the CPU: ``pn.qk_norm`` (in place, Numba) against torch's own
composition (split/view, ``F.rms_norm`` per q and k, NeoX RoPE written out as vLLM's
``forward_native`` does, ``cat``), paired in one process for a Qwen3-like shape
(Hq=32, Hk=8, D=128).

Per case, the two calls alternate for ``--rounds`` rounds of ``--reps`` calls each;
reported: the median over rounds of each round's median time, and the ratio
torch / polynorm (> 1: polynorm faster).  One thread each (``torch.set_num_threads(1)``,
``NUMBA_NUM_THREADS=1``): on a shared 2-core VM more threads measure the neighbours.

    NUMBA_NUM_THREADS=1 python bench/qk_norm.py --out bench/results/qk-norm-2026-12-06-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

HQ, HK, D = 32, 8, 128


def _torch_composition(F, torch, qkv, qw, kw, cache, pos, rope: bool, eps: float):
    t = qkv.shape[0]
    q, k, v = qkv.split([HQ * D, HK * D, HK * D], dim=-1)
    q = F.rms_norm(q.view(t, HQ, D), (D,), qw, eps)
    k = F.rms_norm(k.view(t, HK, D), (D,), kw, eps)
    if rope:
        cos, sin = cache.index_select(0, pos).to(qkv.dtype).chunk(2, dim=-1)
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)

        def rot(x):
            x1, x2 = x.chunk(2, dim=-1)
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

        q, k = rot(q), rot(k)
    return torch.cat([q.reshape(t, -1), k.reshape(t, -1), v], dim=-1)


def run(tokens: list[int], dtypes: list[str], rounds: int, reps: int) -> dict:
    import torch
    import torch.nn.functional as F

    import polynorm as pn

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    rows = []
    for dtype in dtypes:
        dt = getattr(torch, dtype)
        qw = (1 + 0.1 * torch.randn(D, generator=g)).to(dt)
        kw = (1 + 0.1 * torch.randn(D, generator=g)).to(dt)
        inv = 1.0 / (1e6 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
        ang = torch.arange(4096, dtype=torch.float32)[:, None] * inv[None, :]
        cache = torch.cat([ang.cos(), ang.sin()], dim=-1)  # vLLM's float32 cos_sin_cache
        for t in tokens:
            for rope in (True, False):
                qkv = torch.randn(t, (HQ + 2 * HK) * D, generator=g).to(dt)
                pos = torch.randint(0, 4096, (t,), generator=g)
                a = qkv.clone()
                r = (cache, pos, True, D) if rope else None

                def ours(a=a, r=r, qw=qw, kw=kw):
                    pn.qk_norm(a, qw, kw, num_heads_q=HQ, num_heads_k=HK, head_dim=D, rope=r,
                               eps=1e-6)

                def theirs(qkv=qkv, pos=pos, rope=rope, qw=qw, kw=kw, cache=cache):
                    _torch_composition(F, torch, qkv, qw, kw, cache, pos, rope, 1e-6)

                ours(), theirs()  # compile / warm
                per: dict[str, list[float]] = {"polynorm": [], "torch": []}
                for _ in range(rounds):
                    for name, fn in (("polynorm", ours), ("torch", theirs)):
                        ts = []
                        for _ in range(reps):
                            t0 = time.perf_counter()
                            fn()
                            ts.append(time.perf_counter() - t0)
                        per[name].append(statistics.median(ts))
                med = {k: statistics.median(v) for k, v in per.items()}
                rows.append({"T": t, "dtype": dtype, "rope": rope,
                             "polynorm_s": med["polynorm"], "torch_s": med["torch"],
                             "torch_over_polynorm": med["torch"] / med["polynorm"]})
                print(json.dumps(rows[-1]), flush=True)
    return {"what": "QK-norm (+ RoPE), Qwen3 shape (Hq=32, Hk=8, D=128): pn.qk_norm in place "
                    "vs torch's composition, paired, one thread; NUMBA_NUM_THREADS=1 python "
                    "bench/qk_norm.py --out bench/results/qk-norm-2026-12-06-cpu.json",
            "shape": {"Hq": HQ, "Hk": HK, "D": D}, "rounds": rounds, "reps": reps,
            "threads": 1, "machine": platform.machine(), "cpus": os.cpu_count(),
            "torch_composition": "split, F.rms_norm per q/k (weight in the dtype), NeoX rope "
                                 "with cos/sin cast to the dtype (vLLM forward_native), cat",
            "polynorm": "pn.qk_norm in place (Numba), rope=(float32 cache, positions, True, D)",
            "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,64,2048")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    report = run([int(s) for s in a.tokens.split(",")], a.dtypes.split(","), a.rounds, a.reps)
    text = json.dumps(report, indent=1)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
