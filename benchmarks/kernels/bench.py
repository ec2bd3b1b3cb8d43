"""Time each fused kernel against the unfused eager expression and torch.compile of it, at GPT sizes; report
ms, achieved GB/s (bytes each must read and write once), the fraction of the measured device-to-device copy
bandwidth, and the peak memory of cross entropy. GPU only; run by run_gpu.sh. Not run yet (no GPU so far)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from sbp_torch import kernels as K


def _time(fn, reps=20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def copy_bandwidth() -> float:
    x = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    return 2 * x.numel() / _time(lambda: y.copy_(x)) / 1e6  # GB/s


def cases(tokens: int, hidden: int, vocab: int, dtype):
    x, r = (torch.randn(tokens, hidden, device="cuda", dtype=dtype) for _ in range(2))
    v, b = (torch.randn(hidden, device="cuda", dtype=dtype) for _ in range(2))
    logits = torch.randn(tokens // 4, vocab, device="cuda", dtype=dtype)
    target = torch.randint(0, vocab, (tokens // 4,), device="cuda")
    e = x.element_size()
    yield "bias_gelu", (lambda: K.bias_gelu(x, v)), (lambda x, v: F.gelu(x + v, approximate="tanh")), (x, v), 2 * x.numel() * e
    yield "layer_norm", (lambda: K.layer_norm(x, v, b)), (lambda x, v, b: F.layer_norm(x, (hidden,), v, b)), (x, v, b), 2 * x.numel() * e
    yield "rms_norm", (lambda: K.rms_norm(x, v)), (lambda x, v: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * v), (x, v), 2 * x.numel() * e
    yield "scale_mask_softmax", (lambda: K.scale_mask_softmax(x, None, 0.125)), (lambda x: torch.softmax(x * 0.125, -1)), (x,), 2 * x.numel() * e
    yield "bias_dropout_add", (lambda: K.bias_dropout_add(x, v, r, 0.1)), (lambda x, v, r: F.dropout(x + v, 0.1) + r), (x, v, r), 4 * x.numel() * e
    yield "cross_entropy", (lambda: K.cross_entropy(logits, target)), (lambda l, t: F.cross_entropy(l, t)), (logits, target), logits.numel() * e


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/kernels/out")
    args = parser.parse_args()
    K.enable_cuda_kernels()
    copy = copy_bandwidth()
    rows = []
    for tokens, hidden, vocab in [(2048, 1024, 32768), (8192, 4096, 131072), (32768, 8192, 262144)]:
        for dtype in (torch.bfloat16, torch.float32):
            for name, fused, unfused, inputs, nbytes in cases(tokens, hidden, vocab, dtype):
                compiled = torch.compile(unfused)
                times = {"fused": _time(fused), "eager": _time(lambda: unfused(*inputs)), "compile": _time(lambda: compiled(*inputs))}
                row = {"kernel": name, "tokens": tokens, "hidden": hidden, "vocab": vocab, "dtype": str(dtype), **times,
                       "GB/s": nbytes / times["fused"] / 1e6, "of_copy": nbytes / times["fused"] / 1e6 / copy}
                if name == "cross_entropy":
                    for label, fn in (("fused", fused), ("eager", lambda: unfused(*inputs))):
                        torch.cuda.reset_peak_memory_stats()
                        base = torch.cuda.memory_allocated()
                        fn()
                        row[f"peak_MiB_{label}"] = (torch.cuda.max_memory_allocated() - base) / 2**20
                rows.append(row)
                print(row, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name()
    (out / "kernels.json").write_text(json.dumps({"device": device, "copy_GB/s": copy, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
