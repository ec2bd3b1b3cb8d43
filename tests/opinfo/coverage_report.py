"""Write docs/coverage.md from the OpInfo sweep results (``opinfo_sweep.py`` JSONs).

    .venv/bin/python tests/opinfo/coverage_report.py tests/opinfo/results docs/coverage.md

Reads ``<backend>_<mesh>.json`` for the backends sbp and dtensor and the meshes 2, 3 and 2x2 (those that
exist), and writes: pass rates per run, a per-family table, the causes of failure grouped, the failing entries
of sbp_torch with their first error, and the commands that reproduce it all.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter, defaultdict

BACKENDS = ("sbp", "dtensor")
MESHES = ("2", "3", "2x2")
FAILING = ("fail-forward", "fail-backward", "random-stream", "error", "timeout", "diverged")


def load_runs(folder: str) -> dict:
    """(backend, mesh) -> results, for the files that exist."""
    runs = {}
    for backend in BACKENDS:
        for mesh in MESHES:
            path = os.path.join(folder, f"{backend}_{mesh}.json")
            if os.path.exists(path):
                with open(path) as f:
                    runs[backend, mesh] = json.load(f)
    return runs


def _pct(n: int, total: int) -> str:
    return f"{100 * n / total:.1f}%" if total else "-"


def _checked(entries: dict) -> dict:
    return {k: v for k, v in entries.items() if v["status"] != "skipped"}


def _message(detail: str) -> str:
    """The error or mismatch of a detail line, without the phase/sample/layout prefix."""
    return detail.split("]: ", 1)[-1]


def cause(detail: str) -> str:
    """A failure's message with op names, numbers and shapes blanked, so that alike failures group."""
    text = _message(detail)
    text = re.sub(r"aten\.[\w.]+", "aten.<op>", text)
    text = re.sub(r"torch\.Size\(\[[^\]]*\]\)|\([\d, ]*\)|\[[\d, ]*\]", "<shape>", text)
    text = re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "#", text)
    text = text.split(" (rank ")[0]
    return text[:110]


def overall(runs: dict) -> list[str]:
    lines = [
        "| backend | mesh | entries checked | pass | pass % | without fallback | fail fwd | fail bwd "
        "| random stream | error | hang / out of step | skipped | time in sweep | finished |",
        "|" + "---|" * 14,
    ]
    for (backend, mesh), res in runs.items():
        entries = res["entries"]
        checked = _checked(entries)
        counts = Counter(v["status"] for v in entries.values())
        native = sum(1 for v in checked.values() if v["status"] == "pass" and not v.get("fallback", []))
        native_cell = f"{native} ({_pct(native, len(checked))})" if backend == "sbp" else "n/a"
        done = "" if res["meta"].get("complete") else " (incomplete)"
        lines.append(
            f"| {backend} | {mesh} | {len(checked)} | {counts['pass']} | {_pct(counts['pass'], len(checked))} "
            f"| {native_cell} | {counts['fail-forward']} | {counts['fail-backward']} | {counts['random-stream']} "
            f"| {counts['error']} "
            f"| {counts['timeout'] + counts['diverged']} | {counts['skipped']} "
            f"| {res['meta'].get('elapsed_s', 0):.0f} s{done} "
            f"| {res['meta'].get('finished', '-')} |"
        )
    return lines


def families(runs: dict) -> list[str]:
    fams = Counter()
    first = next(iter(runs.values()))["entries"]
    for v in _checked(first).values():
        fams[v["family"]] += 1
    keys = list(runs)
    lines = ["| family | entries | " + " | ".join(f"{b} {m}" for b, m in keys) + " |", "|" + "---|" * (2 + len(keys))]
    for fam, n in sorted(fams.items(), key=lambda kv: -kv[1]):
        cells = []
        for key in keys:
            checked = [v for v in _checked(runs[key]["entries"]).values() if v["family"] == fam]
            cells.append(_pct(sum(v["status"] == "pass" for v in checked), len(checked)))
        lines.append(f"| {fam} | {n} | " + " | ".join(cells) + " |")
    return lines


def causes(runs: dict, backend: str, top: int) -> list[str]:
    """The most common failure causes of one backend, counted over entries (an entry failing on several meshes
    counts once, under the cause of its first failing mesh)."""
    first_fail = {}
    for (b, _), res in runs.items():
        if b != backend:
            continue
        for name, v in res["entries"].items():
            if v["status"] in FAILING and name not in first_fail:
                first_fail[name] = v
    groups = defaultdict(list)
    for name, v in first_fail.items():
        groups[cause(v["detail"])].append(name)
    lines = ["| entries | cause (numbers and op names blanked) | examples |", "|---|---|---|"]
    for text, names in sorted(groups.items(), key=lambda kv: -len(kv[1]))[:top]:
        text = text.replace("|", "\\|")
        lines.append(f"| {len(names)} | {text} | {', '.join(sorted(names)[:4])} |")
    return lines


def failing(runs: dict, backend: str = "sbp") -> list[str]:
    meshes = [m for b, m in runs if b == backend]
    names = sorted(
        {n for (b, _), res in runs.items() if b == backend for n, v in res["entries"].items() if v["status"] in FAILING}
    )
    lines = [
        "| entry | family | " + " | ".join(f"mesh {m}" for m in meshes) + " | first failure |",
        "|" + "---|" * (3 + len(meshes)),
    ]
    for name in names:
        records = [runs[backend, m]["entries"].get(name) for m in meshes]
        statuses = [r["status"] if r else "-" for r in records]
        first = next(r for r in records if r and r["status"] in FAILING)
        detail = first["detail"][:160].replace("|", "\\|")
        lines.append(f"| `{name}` | {first['family']} | " + " | ".join(statuses) + f" | {detail} |")
    return lines


def _commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "sbp_torch"], capture_output=True, text=True)
        return sha.stdout.strip() + (" plus uncommitted changes in sbp_torch/" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def metadata(runs: dict) -> list[str]:
    """Per run, how many passing entries' outputs report other strides or contiguity than the plain op's, and for
    sbp_torch each such entry with its first difference."""
    lines = ["| backend | mesh | passing entries | with other strides or contiguity |", "|---|---|---|---|"]
    for (backend, mesh), res in sorted(runs.items()):
        passing = [v for v in res["entries"].values() if v["status"] == "pass"]
        lines.append(f"| {backend} | {mesh} | {len(passing)} | {sum('metadata' in v for v in passing)} |")
    differing: dict = {}
    for (backend, mesh), res in sorted(runs.items()):
        if backend != "sbp":
            continue
        for name, v in res["entries"].items():
            if v["status"] == "pass" and "metadata" in v:
                differing.setdefault(name, (v["family"], mesh, v["metadata"]))
    lines += ["", "| entry | family | first mesh | first difference (sample, layouts, output) |", "|---|---|---|---|"]
    lines += [
        f"| `{name}` | {family} | {mesh} | {_message(detail)} |"
        for name, (family, mesh, detail) in sorted(differing.items())
    ]
    return lines if differing else lines[:-2] + ["", "No passing entry of sbp_torch reports other metadata."]


def report(runs: dict) -> str:
    meta = next(iter(runs.values()))["meta"]
    out = [
        "# OpInfo coverage",
        "",
        "How many of PyTorch's OpInfo entries (`torch.testing._internal.common_methods_invocations.op_db`) give",
        "the single-process result, forward and backward, when their inputs are global tensors: sbp_torch, and",
        "PyTorch's DTensor under the same harness for comparison. Generated by `tests/opinfo/coverage_report.py`",
        "from the sweep results; do not edit by hand.",
        "",
        f"torch {meta['torch']}, sbp_torch at commit {_commit()}; K = {meta['k']} samples per entry;",
        f"tolerance atol = rtol = {meta['default_tol'][0]:g}, or the OpInfo's own larger float32 override.",
        "",
        "## What is checked",
        "",
        "* Every op_db entry that supports float32 on CPU; its first K samples from",
        '  `op.sample_inputs("cpu", torch.float32, requires_grad=op.supports_autograd)`.',
        "* Each tensor of a sample (input, args, kwargs, tensors inside lists) becomes a global tensor built from",
        "  its full value (`full.to_global(p, broadcast).to_global(sbp=...)`; for DTensor `distribute_tensor`",
        "  with Shard/Replicate/Partial). The SBP of each placement axis is drawn, seeded by entry name and sample",
        "  index (the same on every rank and for both backends), from: split on each dim of size >= 1 (uneven",
        "  sizes included), broadcast, and partial sum (floating tensors only). 0-dim tensors are broadcast.",
        "* Forward: every output's `full_tensor()` against the plain result. Backward (entries that support",
        "  autograd): gradients of `sum(output * fixed random weights)` with respect to every input that requires",
        "  grad. `empty`-like entries compare shapes and dtypes only. Random entries compare values too: both",
        "  runs start from the same seed, and on CPU sbp_torch's random tensors equal one process's",
        "  (`docs/randomness.md`).",
        "* **pass**: every sample matches forward and backward. **fail-forward / fail-backward**: a sample ran",
        "  but a value differs. **random stream**: a value differs in a sample whose plain op drew from torch's",
        "  generator (dropout and bernoulli masks: sbp_torch draws them layout-independently, from uniform values,",
        "  not from torch's own stream for them; `docs/randomness.md`); counted as not passing. **error**: a",
        "  sample raised on the global tensors (first line shown). **timeout**:",
        "  a collective did not complete in 20 s; **diverged**: the ranks ran different sequences of collectives",
        "  (sbp only; either ends the run, which resumes after that entry in fresh processes). **skipped**: no",
        "  float32 on CPU, no samples, sparse inputs, the plain op itself raises (CUDA-only jiterator ops), or",
        "  not run on that backend (`NOT_RUN` in `_opinfo_check.py`: DTensor's `_batch_norm_with_update`, whose",
        "  sharding propagation alone takes 100 s); skipped entries are left out of the percentages.",
        "* *without fallback* (sbp only): passing entries none of whose aten ops went through sbp_torch's broadcast",
        "  fallback (gather every input, run on the full values). The fallback is always correct but not",
        "  distributed; this column is the coverage of the signature tables.",
        "* DTensor shards unevenly like `torch.chunk` (a dim of 4 on 3 ranks is 2, 2, 0), sbp_torch balances",
        "  (2, 1, 1); both are tried with the same draws. DTensor cannot be told to make a `Partial` from a full",
        "  value except by `distribute_tensor` (value / n on each rank); sbp_torch keeps it on rank 0.",
        "",
        "## Pass rates",
        "",
        *overall(runs),
        "",
        "## Per family (pass % of the checked entries)",
        "",
        "Families: by name for matmul, indexing, views, factory/random, some reductions and softmax/norm entries;",
        "then pointwise when the main aten overload has `torch.Tag.pointwise` or the OpInfo is a ufunc; then",
        "ReductionOpInfo, linalg, fft, nn.functional; else other (`family()` in `tests/opinfo/_opinfo_check.py`).",
        "",
        *families(runs),
        "",
        "## sbp_torch: failure causes, grouped",
        "",
        *causes(runs, "sbp", 25),
        "",
        "## sbp_torch: failing entries",
        "",
        "The status on each mesh, and the first failure (phase, sample index, the layouts drawn for its tensors",
        "on the first mesh where it fails, then the error).",
        "",
        *failing(runs, "sbp"),
        "",
        "## Strides and contiguity",
        "",
        "For every passing sample, each global output's strides (of every dim with more than one element: torch's",
        "own kernels disagree on the others) and `is_contiguous` in the contiguous format and, for 4-D and 5-D",
        "outputs, the channels-last one, against the plain output's. A global tensor reports the logical tensor's",
        "strides (`docs/concepts.md`), taken from torch's meta kernels where the output is not a contiguous one of",
        "a rule; a difference here is one of torch's meta kernels disagreeing with its CPU kernel, or a layout",
        "sbp_torch chose (an output of the broadcast fallback takes the CPU kernel's strides on the gathered",
        "values).",
        "",
        *metadata(runs),
        "",
        "## DTensor: failure causes, grouped",
        "",
        *causes(runs, "dtensor", 15),
        "",
        "## Reproduce",
        "",
        "Everything (about 12 minutes on 2 cores: sbp_torch on 2, 3, 2x2 and DTensor on 2, 2x2; writes",
        "`tests/opinfo/results/*.json` and this file; `RUNS=dtensor:3` adds the DTensor row of mesh 3, about 3.5",
        "minutes; a row is shown for every JSON in the folder, with the time it finished):",
        "",
        "```bash",
        "tests/opinfo/run_coverage.sh",
        "```",
        "",
        "One run, or some entries of it (add `--resume` to go on after a timeout):",
        "",
        "```bash",
        ".venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 4 tests/opinfo/opinfo_sweep.py \\",
        "    --mesh 2x2 --backend sbp --out /tmp/sbp_2x2.json --ops matmul,nanquantile",
        ".venv/bin/python tests/opinfo/coverage_report.py tests/opinfo/results docs/coverage.md",
        "```",
        "",
        "`tests/test_opinfo_sweep.py` runs a fixed subset of about 50 entries on 2 ranks in CI.",
        "",
    ]
    return "\n".join(out)


def main(argv: list[str]) -> int:
    folder = argv[1] if len(argv) > 1 else "tests/opinfo/results"
    target = argv[2] if len(argv) > 2 else "docs/coverage.md"
    runs = load_runs(folder)
    if not runs:
        raise SystemExit(f"no sweep results in {folder}")
    with open(target, "w") as f:
        f.write(report(runs))
    print(f"wrote {target} from {len(runs)} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
