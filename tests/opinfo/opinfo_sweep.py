"""OpInfo sweep: run torch's op_db samples on global tensors and compare with one process, forward and backward.

Launch on as many ranks as the mesh has::

    .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 tests/opinfo/opinfo_sweep.py \\
        --mesh 2 --backend sbp --out sweep.json [--ops add,sum,...] [--k 3] [--resume]

For every op_db entry that supports float32 on CPU, the first K samples are checked (see ``_opinfo_check.py``):
each tensor of a sample gets a layout drawn from split (each dim of size >= 1), broadcast and partial sum,
seeded by the entry name and sample index, so every rank and both backends draw the same. An entry passes when
all its samples match forward and, if it supports autograd, backward. Each global output's strides and contiguity
are compared with the plain output's too; the first difference is recorded (``metadata``), not counted as a
failure.

Ranks agree on every sample's outcome (over a process group of their own) before going on, so that an op
raising on one rank cannot leave another blocked in a collective; they also compare the samples they drew and
the sbp_torch collectives they ran. A collective timeout (``--timeout``) or ranks out of step end the run: rank 0
writes what it has, the entry is recorded as "timeout" or "diverged", and ``--resume`` goes on after it in fresh
processes. The JSON is rewritten before each entry, so a crash leaves a resumable file too (the entry in flight
is recorded as a timeout on resume).

``--history`` runs each sample right after a variant of it in the same world: the same tensors and layouts with every
float argument changed (0 to 1.5, any other value to 0), itself checked against one process. A decision cached for
the variant's call must not be replayed for the sample's, whose numbers it may not fit; the entry's record counts
the variants checked (``history_samples``) and a variant's wrong values fail the entry as the sample's would (but
where the changed floats make the plain op give an infinity or NaN, the variant is only a warm-up).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import itertools
import json
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _opinfo_check import (  # noqa: E402
    BACKENDS,
    NOT_RUN,
    VALUES_UNDEFINED,
    SampleCheck,
    SampleFailure,
    describe,
    entry_name,
    family,
    leaves,
    map_tensors,
    stable_seed,
    tolerance,
)

TIMEOUT_EXIT = 3  # a collective timed out or ranks went out of step: partial results written, resume to go on


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mesh", default="2", help="2, 3 or 2x2: the placement / device mesh (= world size)")
    parser.add_argument("--backend", choices=sorted(BACKENDS), default="sbp")
    parser.add_argument("--ops", default="", help="comma-separated entry names (name or name.variant); default all")
    parser.add_argument("--out", default="", help="JSON file for the results (written by rank 0)")
    parser.add_argument("--k", type=int, default=3, help="samples per entry")
    parser.add_argument("--timeout", type=float, default=20.0, help="collective timeout in seconds")
    parser.add_argument("--resume", action="store_true", help="keep the entries already in --out, go on after them")
    parser.add_argument("--compile", default=None, help="run each global call through torch.compile (a backend)")
    parser.add_argument("--history", action="store_true", help="run each sample after a variant with other floats")
    return parser.parse_args()


class CollectiveTrace:
    """The sbp_torch collectives this rank ran since the last agreement, as (group ranks, what). The members of
    a group must have run the same ones on it; if not, their collectives were matched wrongly and the run must
    end there. (Ranks of different groups may differ: one axis group can have even parts, another uneven.)"""

    def __init__(self):
        from sbp_torch._comm import _primitives

        self.calls: list[tuple[tuple[int, ...], str]] = []
        original = _primitives.run

        def tracing(what, group, tensor, call):
            self.calls.append((tuple(sorted(group.ranks)), f"{what} {tensor.dtype}"))
            return original(what, group, tensor, call)

        _primitives.run = tracing

    def take(self) -> list:
        calls, self.calls = self.calls, []
        return calls

    @staticmethod
    def in_step(traces: list[list]) -> bool:
        """Whether every group's members (traces indexed by rank) ran the same collectives on it."""
        groups = {ranks for trace in traces for ranks, _ in trace}
        for ranks in groups:
            seen = {tuple(what for g, what in traces[r] if g == ranks) for r in ranks}
            if len(seen) > 1:
                return False
        return True


class Agreement:
    """All ranks agree on each outcome over a process group of their own, so that a rank blocked in an op's
    collective cannot be mistaken for (or matched with) this exchange."""

    def __init__(self, timeout: float):
        # Longer than an op's collective timeout, so that a rank blocked in one can still report here.
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout + 15))
        self.trace: CollectiveTrace | None = None

    def __call__(self, outcome: tuple, key: str = ""):
        """``outcome`` is ("ok", value) or (kind, message); the agreed one is the first non-ok in rank order
        (a timeout anywhere wins, then ranks that ran different collectives or passed different ``key``s),
        noting when only some ranks saw it. An ok value is not exchanged."""
        mine = outcome if outcome[0] != "ok" else ("ok", None)
        everyone = [None] * dist.get_world_size()
        trace = self.trace.take() if self.trace else []
        try:
            dist.all_gather_object(everyone, (mine, trace, key), group=self.group)
        except RuntimeError as e:  # a rank never came: blocked in a collective that does not time out
            return "timeout", f"a rank did not finish the sample ({describe(e)}); this rank: {mine[1] or 'ok'}"
        in_step = CollectiveTrace.in_step([t for _, t, _ in everyone])
        if (not in_step or len({k for _, _, k in everyone}) > 1) and not any(o[0] == "timeout" for o, _, _ in everyone):
            what = "collectives" if not in_step else "samples"
            errors = "; ".join(f"rank {r}: {o[1]}" for r, (o, _, _) in enumerate(everyone) if o[0] != "ok")
            return "diverged", f"the ranks ran different {what}{': ' + errors if errors else ''}"
        bad = [(r, o) for r, (o, _, _) in enumerate(everyone) if o[0] != "ok"]
        if not bad:
            return outcome  # the ok value stays local (it may be a list of samples)
        rank, (kind, message) = next(((r, o) for r, o in bad if o[0] == "timeout"), bad[0])
        if len(bad) < len(everyone):
            message += f" (rank {rank} only; ranks {[r for r, _ in bad]} failed)"
        cause = next(((r, o) for r, o in bad if o[0] != "timeout"), None)
        if kind == "timeout" and cause:  # the rank that raised is why the others waited
            message = f"rank {cause[0]} raised {cause[1][1]}; so: {message}"
        return kind, message


def _is_timeout(exc: BaseException) -> bool:
    return isinstance(exc, dist.DistBackendError) or "timed out" in str(exc).lower()


def guarded(fn) -> tuple:
    """Run ``fn`` and classify: ("ok", result), ("fail", message), ("error", message) or ("timeout", message)."""
    try:
        return "ok", fn()
    except SampleFailure as e:
        return "fail", str(e)
    except Exception as e:  # noqa: BLE001 - any exception of the op is a result to record
        return ("timeout" if _is_timeout(e) else "error"), describe(e)


class FallbackRecorder:
    """Names of the aten ops that sbp_torch ran through its broadcast fallback (gathered inputs) since
    ``clear``: the dispatcher's record of the ops it warned about."""

    def __init__(self):
        from sbp_torch._dispatch import _fallback

        self._warned = _fallback.warned_ops

    @property
    def ops(self) -> set[str]:
        return {str(func) for func in self._warned}

    def clear(self) -> None:
        self._warned.clear()


def other_floats(sample):
    """The sample with every float argument (not its tensors) changed: 0 to 1.5, any other value to 0; None if it
    has none."""
    from torch.testing._internal.opinfo.core import SampleInput

    changed = []

    def change(value):
        if isinstance(value, float):
            changed.append(value)
            return 1.5 if value == 0 else 0.0
        if isinstance(value, (list, tuple)):
            return type(value)(change(v) for v in value)
        if isinstance(value, dict):
            return {k: change(v) for k, v in value.items()}
        return value

    args, kwargs = change(list(sample.args)), change(dict(sample.kwargs))
    return SampleInput(sample.input, args=tuple(args), kwargs=kwargs) if changed else None


def _non_finite(check) -> bool:
    """Whether the plain op gave an infinity or NaN: a variant's changed floats can divide by zero, and a partial sum
    of infinities is not the infinity of the sum (inf - inf), which says nothing about cached decisions."""
    outputs = [t for t in leaves(check.ref_out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return any(not torch.isfinite(t).all() for t in outputs)


def check_sample(check, agree: Agreement, record: dict, where: str, counter: str = "samples") -> dict | None:
    """Check one sample (forward, and backward where it applies); a failed record, or None (``record`` counted)."""
    kind, value = agree(guarded(check.reference))  # plain tensors; agreed anyway, to be safe
    if kind != "ok":
        return {"skip": f"{where}: the plain op raises {value}"}
    needs_backward = value and check.op.supports_autograd
    kind, value = agree(guarded(check.forward))
    if kind == "fail" and check.draws_random:
        kind = "random"
    if kind != "ok":
        return {**record, **_failed(kind, "forward", where, value)}
    record[counter] += 1
    if check.metadata and "metadata" not in record:  # (the first sample whose outputs report other strides)
        record["metadata"] = f"{where}: {check.metadata[0]}"
    if not needs_backward:
        return None
    ref_grads = check.reference_grads()  # plain tensors only: the same on every rank
    if ref_grads is None:
        return None
    kind, value = agree(guarded(lambda: check.backward(ref_grads)))
    if kind == "fail" and check.draws_random:
        kind = "random"
    if kind != "ok":
        return {**record, **_failed(kind, "backward", where, value)}
    if counter == "samples":
        record["backward_samples"] += 1
    return None


def check_entry(
    op,
    backend,
    mesh_ndim: int,
    k: int,
    agree: Agreement,
    fallback: FallbackRecorder | None,
    compile_backend=None,
    history: bool = False,
) -> dict:
    """Run up to ``k`` samples of one op_db entry (each after a variant with other floats, with ``history``); the
    record for the JSON (same on every rank)."""
    name = entry_name(op)
    record = {"family": family(op), "status": "pass", "detail": "", "samples": 0, "backward_samples": 0}
    if history:
        record["history_samples"] = 0
    if fallback is not None:
        fallback.clear()
    if torch.float32 not in op.supported_dtypes("cpu"):
        return {**record, "status": "skipped", "detail": "no float32 on cpu"}
    if name in NOT_RUN[backend.name]:
        return {**record, "status": "skipped", "detail": f"not run: {NOT_RUN[backend.name][name]}"}
    torch.manual_seed(stable_seed(name))
    kind, samples = guarded(
        lambda: list(itertools.islice(op.sample_inputs("cpu", torch.float32, requires_grad=op.supports_autograd), k))
    )
    kind, samples = agree((kind, samples), key=_shapes(samples) if kind == "ok" else "")
    if kind != "ok" or not samples:
        return {
            **record,
            "status": "skipped",
            "detail": f"sample generation: {samples}" if kind != "ok" else "no samples",
        }
    tol, values_defined = tolerance(op), name not in VALUES_UNDEFINED
    skips = []
    for i, sample in enumerate(samples):
        check = SampleCheck(
            op, sample, backend, mesh_ndim, stable_seed(name, i), tol, values_defined, compile_backend, partial_turn=i
        )
        where = f"sample {i} {check.describe_layouts()}"
        reason = check.skip_reason()
        if reason:
            skips.append(f"{where}: {reason}")
            continue
        variant = other_floats(sample) if history else None
        if variant is not None:  # the same layouts: the variant's calls have the sample's keys where floats are
            earlier = SampleCheck(
                op, variant, backend, mesh_ndim, stable_seed(name, i), tol, values_defined, compile_backend, i
            )
            failed = check_sample(earlier, agree, record, f"{where} (its variant)", "history_samples")
            if failed is not None and "skip" not in failed and not _non_finite(earlier):
                return failed
        failed = check_sample(check, agree, record, where)
        if failed is not None:
            if "skip" in failed:
                skips.append(failed["skip"])
                continue
            return failed
    if not record["samples"]:
        return {**record, "status": "skipped", "detail": f"no sample applies: {skips[0]}"}
    return record


def _shapes(samples) -> str:
    """What must be the same on every rank: the samples' tensor shapes and dtypes, and their other arguments."""
    parts = []
    for sample in samples:
        map_tensors(lambda t: parts.append(f"{tuple(t.shape)}{t.dtype}"), (sample.input, sample.args, sample.kwargs))
        parts.append(repr(sorted(sample.kwargs)))
    return hashlib.sha1("|".join(parts).encode()).hexdigest()


def _failed(kind: str, phase: str, where: str, message: str) -> dict:
    status = {"fail": f"fail-{phase}", "random": "random-stream", "error": "error", "timeout": "timeout"}.get(
        kind, kind
    )
    return {"status": status, "detail": f"{phase} {where}: {message}"}


def load(path: str, families: dict) -> dict:
    """Results of an earlier run; the entry it was running when it ended is recorded as a timeout."""
    with open(path) as f:
        results = json.load(f)
    in_flight = results["meta"].pop("in_flight", None)
    if in_flight and in_flight not in results["entries"]:
        results["entries"][in_flight] = {
            "family": families[in_flight],
            "status": "timeout",
            "samples": 0,
            "detail": "the run ended (crash or hang) while this entry ran",
            "backward_samples": 0,
        }
    results["meta"]["restarts"] = results["meta"].get("restarts", 0) + 1
    return results


def write(path: str, results: dict) -> None:
    if not path or dist.get_rank() != 0:
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def check_same_sources(agree: Agreement) -> None:
    """Stop if the ranks imported different sbp_torch sources (a file edited while they started): their ops
    would run different collectives and hang."""
    digest = hashlib.sha1()
    for name in sorted(m for m in sys.modules if m == "sbp_torch" or m.startswith("sbp_torch.")):
        path = getattr(sys.modules[name], "__file__", None)
        if path:
            with open(path, "rb") as f:
                digest.update(f.read())
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, digest.hexdigest(), group=agree.group)
    if len(set(everyone)) > 1:
        raise SystemExit("the ranks imported different sbp_torch sources (edited during start-up); run again")


def main() -> int:
    if os.environ.get("PYTHONHASHSEED") != "0":
        # Some sample generators iterate over sets of strings, whose order depends on the hash seed: with a
        # random seed per process, ranks would draw different samples.
        os.environ["PYTHONHASHSEED"] = "0"
        os.execv(sys.executable, [sys.executable, *sys.argv])
    args = parse_args()
    torch.set_num_threads(1)  # the ranks share a few cores
    warnings.simplefilter("ignore")  # fallback notices and op_db deprecations would flood the log
    timeout = datetime.timedelta(seconds=args.timeout)
    dist.init_process_group("gloo", timeout=timeout)
    # sbp_torch makes its axis groups with new_group(ranks), whose timeout is torch's default (30 min), not
    # the world's: give them the world's, so that a hang in a sub-group ends in --timeout seconds too.
    new_group = dist.new_group
    dist.new_group = lambda *a, **kw: new_group(*a, **{"timeout": timeout, **kw})
    mesh_shape = tuple(int(s) for s in args.mesh.split("x"))
    if dist.get_world_size() != torch.Size(mesh_shape).numel():
        raise SystemExit(
            f"--mesh {args.mesh} needs {torch.Size(mesh_shape).numel()} ranks, got {dist.get_world_size()}"
        )
    agree = Agreement(args.timeout)
    from torch.testing._internal.common_methods_invocations import op_db

    import sbp_torch  # noqa: F401 - adds Tensor.to_global

    check_same_sources(agree)
    backend = BACKENDS[args.backend](mesh_shape)
    fallback = FallbackRecorder() if args.backend == "sbp" else None
    if args.backend == "sbp":
        agree.trace = CollectiveTrace()
    wanted = set(filter(None, args.ops.split(",")))
    ops = [op for op in op_db if not wanted or entry_name(op) in wanted or op.name in wanted]
    if wanted - {entry_name(op) for op in ops} - {op.name for op in ops}:
        raise SystemExit(
            f"unknown entries: {sorted(wanted - {entry_name(op) for op in ops} - {op.name for op in ops})}"
        )
    # Rank 0 reads the earlier results and sends them: another rank reading the file itself could see the
    # one rank 0 is already writing again.
    shared = [
        load(args.out, {entry_name(op): family(op) for op in op_db})
        if args.resume and args.out and os.path.exists(args.out) and dist.get_rank() == 0
        else {"meta": {}, "entries": {}}
    ]
    dist.broadcast_object_list(shared, src=0, group=agree.group)
    results = shared[0]
    meta = results["meta"]
    meta.update(
        backend=args.backend,
        compile=args.compile,
        history=args.history,
        mesh=args.mesh,
        world_size=dist.get_world_size(),
        torch=torch.__version__,
        k=args.k,
        default_tol=[1e-4, 1e-4],
        timeout_s=args.timeout,
        complete=False,
    )
    start, elapsed = time.monotonic(), meta.get("elapsed_s", 0.0)
    code = 0
    for op in ops:
        name = entry_name(op)
        if name in results["entries"]:
            continue
        meta.update(in_flight=name, elapsed_s=round(elapsed + time.monotonic() - start, 1))
        write(args.out, results)
        t0 = time.monotonic()
        record = check_entry(op, backend, len(mesh_shape), args.k, agree, fallback, args.compile, args.history)
        if fallback is not None:
            record["fallback"] = sorted(fallback.ops)
        record["seconds"] = round(time.monotonic() - t0, 2)
        results["entries"][name] = record
        if dist.get_rank() == 0 and record["status"] != "pass":
            print(f"{name}: {record['status']}: {record['detail'][:200]}", flush=True)
        if record["status"] in ("timeout", "diverged"):
            code = TIMEOUT_EXIT
            break
    meta.pop("in_flight", None)
    meta.update(
        complete=code == 0,
        elapsed_s=round(elapsed + time.monotonic() - start, 1),
        finished=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    )
    write(args.out, results)
    if dist.get_rank() == 0:
        counts = {}
        for r in results["entries"].values():
            counts[r["status"]] = counts.get(r["status"], 0) + 1
        print(f"{args.backend} mesh {args.mesh}: {counts} in {meta['elapsed_s']} s", flush=True)
    if code:
        os._exit(code)  # a timed-out gloo group cannot be torn down cleanly
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
