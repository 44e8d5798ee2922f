"""A Hugging Face Llama training step with and without ``polynorm.torch.patch``.

    flock /tmp/polynorm-bench.lock python bench/hf.py [--sizes tiny,small] [--dtype float32]
        [--tokens 512] [--pairs 7] [--device cpu|cuda] [--json bench/results/hf-cpu.json]

One step is ``loss = model(input_ids, labels=input_ids).loss; loss.backward()``
on randomly initialised ``LlamaForCausalLM`` models (no download).  The HF and
the patched model are timed alternately (the order flips every pair), and the
speed-up quoted is the median over pairs of ``t_hf / t_patched``: on a shared
machine only a ratio measured side by side means anything.  Memory: the bytes
autograd saves for the backward (every saved tensor's storage counted once,
exact and load-independent), and the peak RSS of a child process that builds
one model and runs two steps (includes the model itself).  On ``--device cuda``
(run by ``bench/gpu_check.sh``) each step is timed between synchronisations and
the peak is torch's ``max_memory_allocated`` instead of the RSS.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SIZES = {
    # layers, hidden, intermediate, heads, kv heads
    "tiny": (2, 1024, 2816, 16, 4),
    "small": (8, 1024, 2816, 16, 4),
    "wide": (2, 4096, 11008, 32, 8),
}
VOCAB = 32000


def _model(size: str, dtype):
    import torch
    import transformers as T

    layers, d, inter, heads, kv = SIZES[size]
    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=VOCAB, hidden_size=d, intermediate_size=inter,
                        num_hidden_layers=layers, num_attention_heads=heads,
                        num_key_value_heads=kv, max_position_embeddings=4096)
    return T.LlamaForCausalLM(cfg).to(dtype).train()


def _batch(tokens: int, device: str = "cpu"):
    import torch

    g = torch.Generator().manual_seed(1)
    seq = min(tokens, 512)
    return torch.randint(0, VOCAB, (tokens // seq, seq), generator=g).to(device)


def _step(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item()  # .item() synchronises a CUDA step


def _peak_cuda_mb(model, ids) -> float:
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    _step(model, ids)
    return torch.cuda.max_memory_allocated() / 2**20


def _saved_bytes(model, ids) -> int:
    """Bytes of the distinct storages autograd saves for the backward of one step."""
    import torch

    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
        return t

    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in seen.items() if ptr not in params)


def _child(size: str, dtype_name: str, tokens: int, patched: bool) -> None:
    import torch

    from polynorm.torch import patch

    model = _model(size, getattr(torch, dtype_name))
    if patched:
        patch(model)
    ids = _batch(tokens)
    for _ in range(2):
        _step(model, ids)
    print(json.dumps({"max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def _peak_rss(size: str, dtype_name: str, tokens: int, patched: bool) -> float:
    cmd = [sys.executable, __file__, "--child", size, "--dtype", dtype_name,
           "--tokens", str(tokens)] + (["--patched"] if patched else [])
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["max_rss_mb"]


def _median(v):
    v = sorted(v)
    return v[len(v) // 2]


def run(size: str, dtype_name: str, tokens: int, pairs: int, rss: bool,
        device: str = "cpu") -> dict:
    import torch

    from polynorm.torch import patch

    ref = _model(size, getattr(torch, dtype_name)).to(device)
    pm = copy.deepcopy(ref)
    n_norms = patch(pm)
    ids = _batch(tokens, device)
    loss_hf, loss_pn = _step(ref, ids), _step(pm, ids)  # warm-up (numba compiles here)
    t_hf, t_pn, ratios = [], [], []
    for i in range(pairs):
        order = [(ref, t_hf), (pm, t_pn)]
        if i % 2:
            order.reverse()
        for model, times in order:
            t0 = time.perf_counter()
            _step(model, ids)
            times.append(time.perf_counter() - t0)
        ratios.append(t_hf[-1] / t_pn[-1])
    rec = {
        "size": size, "device": device, "layers": SIZES[size][0], "hidden": SIZES[size][1],
        "intermediate": SIZES[size][2], "vocab": VOCAB, "dtype": dtype_name,
        "tokens": tokens, "shape": list(ids.shape), "norm_modules": n_norms,
        "pairs": pairs, "median_s_hf": _median(t_hf), "median_s_patched": _median(t_pn),
        "speedup_median_paired": _median(ratios), "ratios": ratios,
        "loss_hf": loss_hf, "loss_patched": loss_pn,
        "saved_for_backward_mb_hf": _saved_bytes(ref, ids) / 2**20,
        "saved_for_backward_mb_patched": _saved_bytes(pm, ids) / 2**20,
    }
    if device != "cpu":
        rec["peak_cuda_mb_hf"] = _peak_cuda_mb(ref, ids)
        rec["peak_cuda_mb_patched"] = _peak_cuda_mb(pm, ids)
    del ref, pm
    if rss and device == "cpu":
        rec["peak_rss_mb_hf"] = _peak_rss(size, dtype_name, tokens, False)
        rec["peak_rss_mb_patched"] = _peak_rss(size, dtype_name, tokens, True)
    return rec


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="tiny,small", help=f"comma list of {list(SIZES)}")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--pairs", type=int, default=7)
    p.add_argument("--device", default="cpu", help="torch device: cpu (default) or cuda")
    p.add_argument("--no-rss", action="store_true", help="skip the peak-RSS child processes")
    p.add_argument("--note", default="", help="stored in the JSON (e.g. machine load)")
    p.add_argument("--json", default=None, help="default bench/results/hf-cpu-<date>.json")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--patched", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        _child(a.child, a.dtype, a.tokens, a.patched)
        return 0
    import numba
    import torch
    import transformers

    from polynorm.bench.common import machine_info

    info = machine_info()
    load_start = os.getloadavg()
    records = []
    for size in a.sizes.split(","):
        rec = run(size, a.dtype, a.tokens, a.pairs, not a.no_rss, a.device)
        print(json.dumps({k: v for k, v in rec.items() if k != "ratios"}), file=sys.stderr)
        records.append(rec)
    doc = {
        "machine": info,
        "meta": {"suite": "hf", "command": "python bench/hf.py " + " ".join(argv),
                 "note": a.note, "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
                 "torch": torch.__version__,
                 "transformers": transformers.__version__, "numba": numba.__version__,
                 "torch_threads": torch.get_num_threads()},
        "records": records,
    }
    kind = "cpu" if a.device == "cpu" else "gpu"
    path = Path(a.json or f"bench/results/hf-{kind}-{info['date'][:10]}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {path}")
    for r in records:
        print(f"{r['size']:>6} ({r['layers']} layers, d={r['hidden']}, {r['dtype']}, "
              f"{r['tokens']} tokens): HF {r['median_s_hf']:.3f} s, patched "
              f"{r['median_s_patched']:.3f} s, paired speed-up x{r['speedup_median_paired']:.3f}; "
              f"saved for backward {r['saved_for_backward_mb_hf']:.0f} -> "
              f"{r['saved_for_backward_mb_patched']:.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
