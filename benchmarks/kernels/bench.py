"""Time each fused kernel, forward and forward + backward, against the unfused eager expression, torch.compile
of it, and Liger-Kernel's Triton kernel where Liger has one; report the median and the 10th-90th percentile
of per-call times, the bandwidth the bytes each call must move imply, and its fraction of the device-to-device
copy bandwidth measured in the same run. GPU only; run by scripts/gpu.sh (stage kernel_bench, which puts Liger
on the path).

    python -m benchmarks.kernels.bench [--out DIR]           # measure: docs/benchmarks/kernels.{json,md} (and DIR/)
    python -m benchmarks.kernels.bench --report FILE.json    # docs/benchmarks/kernels.md from a measurement

Sizes run largest first (the targets are stated there). torch.compile and Liger compile per shape and
dtype; past --budget seconds the remaining compiled and Liger variants are skipped (the table says so), so
that a run stays within its device time.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks import harness
from sbp_torch import kernels as K

SIZES = [(32768, 8192), (8192, 4096), (2048, 1024)]  # tokens x hidden; cross entropy: tokens / 4 x 32 * hidden
DOCS = Path(harness.DOCS)
VARIANTS = ("fused", "eager", "compile", "liger")


def liger_functions() -> dict:
    """Liger-Kernel's autograd functions for the ops it has (layer norm, RMS norm, softmax, cross entropy);
    empty when it is not installed. Liger has no bias-GELU (only GEGLU) and no dropout."""
    try:
        from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.softmax import LigerSoftmaxFunction
    except Exception as err:  # not installed, or not importable with this torch / triton
        print(f"Liger-Kernel not available: {type(err).__name__}: {err}", flush=True)
        return {}
    return {
        "layer_norm": lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, 1e-5),
        # "llama" casting (rstd in float32), dY kept (not overwritten by dX)
        "rms_norm": lambda x, w: LigerRMSNormFunction.apply(x, w, 1e-6, 0.0, "llama", False),
        # Liger's softmax has no scale: it moves the same bytes
        "scale_mask_softmax": lambda x: LigerSoftmaxFunction.apply(x),
        # writes the logits' gradient into the logits during the forward
        "cross_entropy": lambda logits, t: LigerCrossEntropyFunction.apply(logits, t, None, -100)[0],
    }


def cases(tokens: int, hidden: int, dtype):
    """(name, fused, unfused, inputs, differentiable input count, bytes forward, bytes backward): each
    function takes the inputs (and reads sizes from them: one torch.compile serves every size); bytes are
    what a call must read and write at least."""
    x, r = (torch.randn(tokens, hidden, device="cuda", dtype=dtype) for _ in range(2))
    v, b = (torch.randn(hidden, device="cuda", dtype=dtype) for _ in range(2))
    n, e = x.numel(), x.element_size()
    yield "bias_gelu", K.bias_gelu, lambda x, v: F.gelu(x + v, approximate="tanh"), (x, v), 2, 2 * n * e, 3 * n * e
    yield (
        "bias_dropout_add",
        lambda x, v, r: K.bias_dropout_add(x, v, r, 0.1),
        lambda x, v, r: F.dropout(x + v, 0.1) + r,
        (x, v, r),
        3,
        n * (3 * e + 1),
        n * (2 * e + 1),
    )
    yield (
        "scale_mask_softmax",
        lambda x: K.scale_mask_softmax(x, None, 0.125),
        lambda x: torch.softmax(x * 0.125, -1),
        (x,),
        1,
        2 * n * e,
        3 * n * e,
    )
    yield (
        "layer_norm",
        K.layer_norm,
        lambda x, v, b: F.layer_norm(x, x.shape[-1:], v, b),
        (x, v, b),
        3,
        2 * n * e,
        3 * n * e,
    )
    yield (
        "rms_norm",
        K.rms_norm,
        lambda x, v: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * v,
        (x, v),
        2,
        2 * n * e,
        3 * n * e,
    )
    del x, r
    logits = torch.randn(tokens // 4, 32 * hidden, device="cuda", dtype=dtype)
    target = torch.randint(0, logits.shape[1], (logits.shape[0],), device="cuda")
    m = logits.numel() * e
    yield "cross_entropy", K.cross_entropy, F.cross_entropy, (logits, target), 1, m, 2 * m


class Timer:
    """Per-call GPU times by CUDA events, the L2 cache flushed before each call (H100: 50 MB)."""

    def __init__(self):
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")

    def __call__(self, fn, budget_ms: float = 40.0, reps=(5, 50)) -> list[float]:
        fn()  # warm-up: compiles, allocator
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        n = int(min(max(budget_ms / max(start.elapsed_time(end), 1e-3), reps[0]), reps[1]))
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        for s, t in events:
            self.flush.zero_()
            s.record()
            fn()
            t.record()
        torch.cuda.synchronize()
        return sorted(s.elapsed_time(t) for s, t in events)


def percentile(sorted_times: list[float], q: float) -> float:
    return sorted_times[min(len(sorted_times) - 1, max(0, math.ceil(q * len(sorted_times)) - 1))]


def copy_bandwidth(timer: Timer) -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    times = timer(lambda: y.copy_(x))
    return 2 * x.numel() / percentile(times, 0.5) / 1e6  # GB/s, bytes read and written


def forward_backward(fn, inputs, differentiable: int):
    """A call of fn on inputs whose first ``differentiable`` floating tensors require grad, then backward of
    a fixed output gradient; the gradients are cleared per call (no accumulation kernels)."""
    leaves = [
        t.detach().requires_grad_(i < differentiable) if t.is_floating_point() else t for i, t in enumerate(inputs)
    ]
    out = fn(*leaves)
    grad = torch.randn_like(out)
    del out

    def call():
        for t in leaves:
            if isinstance(t, torch.Tensor):
                t.grad = None
        fn(*leaves).backward(grad)

    return call


def measure(args) -> dict:
    try:  # every shape recompiles (dynamic=False)
        torch._dynamo.config.recompile_limit = 64
    except AttributeError:
        torch._dynamo.config.cache_size_limit = 64
    K.enable_cuda_kernels()
    timer = Timer()
    copy = copy_bandwidth(timer)
    liger = liger_functions()
    compiled: dict = {}  # (name, mode, dtype) -> one torch.compile per expression, dtype and mode
    started, rows = time.monotonic(), []
    for tokens, hidden in SIZES:
        for dtype in (torch.bfloat16, torch.float32):
            for name, fused, unfused, inputs, diff, fwd_bytes, bwd_bytes in cases(tokens, hidden, dtype):
                for mode, nbytes in (("forward", fwd_bytes), ("forward+backward", fwd_bytes + bwd_bytes)):
                    fns = {"fused": fused, "eager": unfused}
                    late = time.monotonic() - started > args.budget
                    if not late:
                        key = (name, mode, dtype)
                        fns["compile"] = compiled.setdefault(key, torch.compile(unfused, dynamic=False))
                        if name in liger:
                            fns["liger"] = liger[name]
                    row = {"kernel": name, "mode": mode, "tokens": tokens, "hidden": hidden, "dtype": str(dtype)}
                    row["at_s"] = round(time.monotonic() - started, 1)  # when it started: where the time goes
                    row["shape"] = list(inputs[0].shape)
                    for variant, fn in fns.items():
                        args_ = inputs
                        if variant == "liger" and name == "cross_entropy":  # Liger writes into the logits
                            args_ = (inputs[0].clone(), inputs[1])
                        try:
                            forward = mode == "forward"
                            call = (lambda f=fn, a=args_: f(*a)) if forward else forward_backward(fn, args_, diff)
                            times = timer(call)
                        except Exception as err:  # a variant that fails is reported, the rest measured
                            row[variant] = {"error": f"{type(err).__name__}: {err}"[:200]}
                            continue
                        med = percentile(times, 0.5)
                        row[variant] = {
                            "ms": med,
                            "p10": percentile(times, 0.1),
                            "p90": percentile(times, 0.9),
                            "calls": len(times),
                            "GB/s": nbytes / med / 1e6,
                            "of_copy": nbytes / med / 1e6 / copy,
                        }
                        del args_
                    if late:
                        row["skipped"] = "compile and Liger skipped: past the time budget"
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()
    versions = {"torch": torch.__version__, "triton": _version("triton"), "liger_kernel": _version("liger-kernel")}
    return {"device": torch.cuda.get_device_name(), "copy_GB/s": copy, **versions, "rows": rows}


def _version(distribution: str) -> str:
    """The installed version of a distribution (its metadata: liger_kernel has no ``__version__``), or "absent"."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return "absent"


def _cell(row: dict, variant: str) -> str:
    m = row.get(variant)
    if m is None:
        return "—"
    if "error" in m:
        return "error"
    return f"{m['ms']:.3f} ({m['p10']:.3f}–{m['p90']:.3f})"


def _ratio(row: dict, variant: str) -> str:
    m, f = row.get(variant), row.get("fused")
    if not m or "ms" not in m or not f or "ms" not in f:
        return "—"
    return f"{m['ms'] / f['ms']:.2f}"


def report(measured: dict) -> str:
    """Markdown tables of one measurement: one per mode, the targets' ratios per row."""
    lines = [
        f"Device: {measured['device']}; torch {measured.get('torch')}, triton {measured.get('triton')}, "
        f"Liger-Kernel {measured.get('liger_kernel')}. Device-to-device copy {measured['copy_GB/s']:.0f} GB/s "
        "(bytes read and written, measured in the same run). Times: median ms per call (10th–90th percentile), "
        "CUDA events, L2 flushed before each call. GB/s and *of copy* count the bytes the fused call must read "
        "and write at least (fused column). *x / fused*: how many times longer x takes. Liger: LigerLayerNorm, "
        "LigerRMSNorm (llama casting), LigerSoftmax (no scale), LigerCrossEntropy; it has no bias-GELU or "
        "dropout. Cross entropy: logits tokens/4 x 32*hidden.",
        "",
    ]
    for mode in ("forward", "forward+backward"):
        lines += [
            f"### {mode}",
            "",
            "| kernel | shape | dtype | fused | of copy | eager | compile | liger | eager / fused | "
            "compile / fused | liger / fused |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in (r for r in measured["rows"] if r["mode"] == mode):
            of_copy = f"{r['fused']['of_copy']:.2f}" if "of_copy" in r.get("fused", {}) else "—"
            lines.append(
                f"| {r['kernel']} | {' x '.join(map(str, r['shape']))} | {r['dtype'].removeprefix('torch.')} | "
                f"{_cell(r, 'fused')} | {of_copy} | {_cell(r, 'eager')} | {_cell(r, 'compile')} | "
                f"{_cell(r, 'liger')} | {_ratio(r, 'eager')} | {_ratio(r, 'compile')} | {_ratio(r, 'liger')} |"
            )
        lines.append("")
    return "\n".join(lines)


HEADER = (
    "# Fused kernels against eager, torch.compile and Liger-Kernel\n\n<!-- generated by "
    "`python -m benchmarks.kernels.bench` (scripts/gpu.sh); do not edit -->\n\n"
)


def write(measured: dict, *dirs: Path) -> None:
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
        (d / "kernels.json").write_text(json.dumps(measured, indent=1))
        (d / "kernels.md").write_text(HEADER + report(measured))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", help="a folder that also gets kernels.json and kernels.md (scripts/gpu.sh's logs)")
    parser.add_argument("--budget", type=float, default=90.0, help="seconds after which compile/Liger are skipped")
    parser.add_argument("--report", help="write docs/benchmarks/kernels.md from this kernels.json; measure nothing")
    args = parser.parse_args()
    if args.report:
        write(json.loads(Path(args.report).read_text()), DOCS)
        return
    write(measure(args), DOCS, *([Path(args.out)] if args.out else []))


if __name__ == "__main__":
    main()
