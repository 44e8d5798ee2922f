"""Memory of a training step with ``save="input"``, ``save="output"`` and ``in_place``.

    flock /tmp/polynorm-bench.lock python bench/lean_memory.py [--layers 8] [--tokens 2048]
        [--hidden 1024] [--dtype bfloat16] [--pairs 5] [--json bench/results/lean-memory.json]

The model is a stack of pre-norm blocks, ``h = h + W2 gelu(W1 rms_norm(h))``
(``polynorm.torch.RMSNorm`` with a weight, ``torch.nn.Linear`` without bias),
as the residual stream of a transformer without attention.  One step is
forward, ``loss = out.float().square().mean()``, backward.

Memory is the bytes autograd keeps for the backward: every saved tensor's
storage counted once (``torch.autograd.graph.saved_tensors_hooks``), exact and
independent of the machine's load.  The step time of both settings is measured
alternately and quoted as the median ratio over pairs.

``in_place=True`` (the backward writes ``dx`` over ``dy``) saves no saved tensor
but an allocation in the backward: measured as the peak of the memory polynorm's
kernels allocate during the backward (their results are numpy allocations, which
``tracemalloc`` traces; torch's own are not traced), with and without it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import polynorm.torch as pnt


def _model(layers: int, hidden: int, dtype, save: str, in_place: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = pnt.RMSNorm(hidden, eps=1e-6, save=save, in_place=in_place, dtype=dtype)
            self.up = torch.nn.Linear(hidden, 4 * hidden, bias=False, dtype=dtype)
            self.down = torch.nn.Linear(4 * hidden, hidden, bias=False, dtype=dtype)

        def forward(self, h):
            return h + self.down(torch.nn.functional.gelu(self.up(self.norm(h))))

    return torch.nn.Sequential(*[Block() for _ in range(layers)])


def _saved_bytes(model, x) -> int:
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x).float().square().mean()
    loss.backward()
    return sum(seen.values())


def _backward_peak_traced(model, x) -> int:
    """Peak bytes traced by ``tracemalloc`` (numpy's allocations) during the backward."""
    import tracemalloc

    loss = model(x).float().square().mean()
    tracemalloc.start()
    try:
        loss.backward()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _step(model, x) -> float:
    t = time.perf_counter()
    model(x).float().square().mean().backward()
    return time.perf_counter() - t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    dtype = getattr(torch, a.dtype)
    x = torch.randn(a.tokens, a.hidden, dtype=dtype, requires_grad=True)
    models = {s: _model(a.layers, a.hidden, dtype, s) for s in ("input", "output")}
    saved = {s: _saved_bytes(m, x) for s, m in models.items()}
    for m in models.values():
        _step(m, x)  # warm: kernels compiled, allocator primed
    ratios = []
    for i in range(a.pairs):
        order = ("input", "output") if i % 2 == 0 else ("output", "input")
        t = {s: _step(models[s], x) for s in order}
        ratios.append(t["output"] / t["input"])
    in_place = {ip: _model(a.layers, a.hidden, dtype, "input", ip) for ip in (False, True)}
    for m in in_place.values():
        _step(m, x)
    peak = {ip: _backward_peak_traced(m, x) for ip, m in in_place.items()}
    norm_input = a.tokens * a.hidden * x.element_size() * a.layers
    rec = {
        "bench": "lean_memory", "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__, "layers": a.layers, "tokens": a.tokens,
        "hidden": a.hidden, "dtype": a.dtype,
        "saved_bytes_input": saved["input"], "saved_bytes_output": saved["output"],
        "saved_fraction": saved["output"] / saved["input"],
        "bytes_saved": saved["input"] - saved["output"],
        "norm_inputs_bytes": norm_input,
        "step_time_ratio_output_over_input": statistics.median(ratios),
        "backward_peak_traced_bytes": peak[False],
        "backward_peak_traced_bytes_in_place": peak[True],
        "activation_bytes": a.tokens * a.hidden * x.element_size(),
        "pairs": a.pairs,
    }
    print(json.dumps(rec, indent=1))
    if a.json:
        a.json.write_text(json.dumps(rec, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
