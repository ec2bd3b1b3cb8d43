"""The one-process rule checker: every signature of every rule, run on simulated ranks, against the plain op.

For one op call on whole tensors (``SampleCall``) and a placement shape, the checker asks the call's rule for its
signatures (as the dispatcher would, every tensor argument global), and for each N-D signature it builds every rank's
local parts of the inputs (regions of splits, the whole value for broadcasts, random parts that reduce to the value for
partials), runs the op (or the signature's local function, on one thread per rank whose ``all_reduce`` meets the
others') on each rank's parts, and puts the logical outputs back together from the local ones: a split from the
regions, a broadcast from any rank (every rank must agree), a partial by reducing. A signature is *wrong* where a local
part has another shape than its layout gives, the ranks of a broadcast disagree, the op raises on a rank, or the
logical outputs differ from the op run on the whole tensors.

``missing_signatures`` searches the other way: for a call on two ranks, every layout of the inputs (a split of each
dim, broadcast, each partial) under which the plain op's local outputs form some layout of the logical outputs, and
that the rule does not offer: valid signatures the rule misses.

Sample calls come from torch's OpInfo database: each op's sample inputs run forward and backward on float64 CPU
tensors, and every aten call that has a rule is recorded, so backward ops are checked as ops of their own. Calls of
CUDA kernels that a CPU cannot run are checked on meta tensors, for their local shapes only (``shapes_only``).

Run as a script for a report: ``python tests/rule_checker.py [--missing] [--ops NAME ...]``.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import sbp_torch as st
from sbp_torch._dispatch._bound import by_name
from sbp_torch._dispatch._schema import op_schema
from sbp_torch._layout import GlobalMeta, Partial, Split, broadcast, check_partial_dtype, narrow_to, reduction_identity
from sbp_torch._signatures import LocalContext, OpCall, Signature, TensorInfo, rule_for, shown_arguments
from sbp_torch._signatures.core import PARTIALS

aten = torch.ops.aten

PLACEMENTS = {"2": (2,), "3": (3,), "4": (4,), "2x2": (2, 2)}
# Ops whose outputs hold no defined values (only their shapes are compared) or that draw random numbers.
UNDEFINED_VALUES = {
    aten.empty_like.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
    aten.empty.memory_format,
}
TOLERANCE = {"rtol": 1e-6, "atol": 1e-7}


@dataclass
class SampleCall:
    """One aten call on whole (plain) tensors; ``shapes_only`` where its kernel cannot run here (meta tensors)."""

    func: object
    args: tuple
    kwargs: dict
    shapes_only: bool = False

    def __repr__(self) -> str:
        def show(v):
            if isinstance(v, torch.Tensor):
                return f"T{list(v.shape)}:{str(v.dtype).removeprefix('torch.')}"
            if isinstance(v, (list, tuple)):
                return "[" + ", ".join(map(show, v)) + "]"
            return repr(v)

        inside = [show(a) for a in self.args] + [f"{k}={show(v)}" for k, v in self.kwargs.items()]
        return f"{self.func}({', '.join(inside)})"


@dataclass
class Finding:
    """A wrong signature: the call, the placement, the N-D signature and what went wrong."""

    call: SampleCall
    mesh: tuple[int, ...]
    combo: tuple[Signature, ...]
    problem: str

    def __str__(self) -> str:
        return f"{self.call} on {self.mesh}: {' x '.join(map(repr, self.combo))}: {self.problem}"


# -- sample calls ------------------------------------------------------------------------------------------------


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls: list[SampleCall] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if rule_for(func) is not None:
            self.calls.append(SampleCall(func, _detached(args), _detached(kwargs)))
        return out


def _detached(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_detached(v) for v in value)
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    return value


def _shape_key(call: SampleCall):
    leaves, _ = tree_flatten((call.args, call.kwargs))
    return (call.func, tuple((tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else repr(v) for v in leaves))


def sample_calls(per_op: int = 3, samples_per_opinfo: int = 3, names=None) -> list[SampleCall]:
    """Recorded aten calls with rules (forward and backward of OpInfo samples, float64 on the CPU), at most ``per_op``
    distinct ones per op; ``names`` limits the OpInfos to those names."""
    from torch.testing._internal.common_methods_invocations import op_db

    calls, seen, per_func = [], set(), {}
    for info in op_db:
        if names and info.name not in names:
            continue
        try:
            # The OpInfo's own generator, its first few samples: OpInfo.sample_inputs wraps it in an iterator that
            # walks the stack (inspect.stack) to find a unittest case and reseeds torch before every sample, which
            # under pytest's deep stack cost a minute for this sample
            torch.manual_seed(0)
            generated = info.sample_inputs_func(info, "cpu", torch.float64, info.supports_autograd)
            samples = list(itertools.islice(generated, samples_per_opinfo))
        except Exception:  # noqa: BLE001 - an OpInfo without float64 samples
            continue
        for sample in samples:
            recorder = _Recorder()
            try:
                with recorder:
                    out = info(sample.input, *sample.args, **sample.kwargs)
                    outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor) and o.requires_grad]
                    if outs:
                        torch.autograd.backward([o.sum() for o in outs])
            except Exception:  # noqa: BLE001 - the calls recorded before the error still count
                pass
            for call in recorder.calls:
                key = _shape_key(call)
                if key in seen or per_func.get(call.func, 0) >= per_op or _skipped(call):
                    continue
                seen.add(key)
                per_func[call.func] = per_func.get(call.func, 0) + 1
                calls.append(call)
    return calls


# The numbers where scaling stops being linear: a rule that keeps a partial through a number must stop at them
EXTREMES = (0.0, -0.0, math.inf, -math.inf, math.nan)


def with_extreme_numbers(calls: list[SampleCall]) -> list[SampleCall]:
    """Each call that passes a number (a Scalar argument, or a number in a tensor's place), again with one such number
    replaced by each of ``EXTREMES`` (an integer by 0 alone), where the plain op still runs."""
    out = []
    for call in calls:
        if call.shapes_only:
            continue
        arguments = call.func._schema.arguments
        numeric = {a.name for a in arguments if str(a.type) in ("number", "Tensor", "Optional[Tensor]")}
        slots = [(None, i) for i, a in enumerate(call.args) if i < len(arguments) and arguments[i].name in numeric]
        slots += [(k, None) for k in call.kwargs if k in numeric]
        for key, index in slots:
            value = call.kwargs[key] if key is not None else call.args[index]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            for extreme in EXTREMES if isinstance(value, float) else (0,):
                args, kwargs = list(call.args), dict(call.kwargs)
                if key is None:
                    args[index] = extreme
                else:
                    kwargs[key] = extreme
                variant = SampleCall(call.func, tuple(args), kwargs)
                try:
                    expected_outputs(variant)
                except Exception:  # noqa: BLE001 - the plain op refuses the number: nothing to check
                    continue
                out.append(variant)
    return out


def _skipped(call: SampleCall) -> bool:
    """Calls the checker leaves out: random draws (checked in tests/test_random_ops.py), ``out=`` variants."""
    return torch.Tag.nondeterministic_seeded in call.func.tags or bool(op_schema(call.func).outs)


# -- what a call looks like to its rule -------------------------------------------------------------------------


def _describe(value):
    return TensorInfo(tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else value


def tensor_slots(call: SampleCall) -> list[tuple[str, int | None]]:
    """(schema name, index in a list or None) of every tensor argument: all of them are global in a check."""
    slots = []
    for name, value in by_name(op_schema(call.func), call.args, call.kwargs).items():
        for index, v in enumerate(value) if isinstance(value, (list, tuple)) else [(None, value)]:
            if isinstance(v, torch.Tensor):
                slots.append((name, index))
    return slots


def _tensor_at(call: SampleCall, slot) -> torch.Tensor:
    name, index = slot
    value = by_name(op_schema(call.func), call.args, call.kwargs)[name]
    return value if index is None else value[index]


def _with_tensors(call: SampleCall, replace: Callable) -> tuple[list, dict]:
    """The call's (args, kwargs) with every tensor argument ``t`` at slot ``s`` replaced by ``replace(s, t)``."""
    names = op_schema(call.func).names

    def swap(name, value):
        if isinstance(value, torch.Tensor):
            return replace((name, None), value)
        if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
            return type(value)(replace((name, i), v) if isinstance(v, torch.Tensor) else v for i, v in enumerate(value))
        return value

    return [swap(names[i], a) for i, a in enumerate(call.args)], {k: swap(k, v) for k, v in call.kwargs.items()}


def _run(call: SampleCall, args, kwargs) -> list[torch.Tensor]:
    out = call.func(*args, **kwargs)
    return [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]


def _on_meta(call: SampleCall) -> SampleCall:
    args, kwargs = _with_tensors(call, lambda slot, t: t.to("meta"))
    return SampleCall(call.func, tuple(args), kwargs, True)


def expected_outputs(call: SampleCall) -> list[torch.Tensor]:
    """The op on the whole tensors (copies: in-place ops write them); on meta tensors for ``shapes_only`` calls."""
    if call.shapes_only:
        call = _on_meta(call)
    args, kwargs = _with_tensors(call, lambda slot, t: t.clone())
    return _run(call, args, kwargs)


def shown_call(call: SampleCall, mesh: tuple[int, ...], outputs: list[torch.Tensor]) -> OpCall:
    rule = rule_for(call.func)
    arguments = by_name(op_schema(call.func), call.args, call.kwargs)
    shown = shown_arguments(call.func, arguments, rule.reads, _describe)
    names = frozenset(name for name, _ in tensor_slots(call))
    return OpCall(call.func, shown, tuple(TensorInfo(tuple(o.shape), o.dtype) for o in outputs), mesh, names)


def resolved(signature: Signature, slots, call: SampleCall, outputs) -> tuple[tuple, tuple] | None:
    """(input SBPs per slot, output SBPs) of a 1-D signature, or None where it does not fit the call (as the
    dispatcher's ``_resolve``); a tensor the signature does not name raises."""
    sbps = []
    for slot in slots:
        sbp = signature.sbp_of(*slot)
        if sbp is None:
            raise AssertionError(f"{call.func}: {signature} names no SBP for {slot}")
        sbps.append(sbp)
    outs = signature.output_sbps(len(outputs))
    if len(outs) != len(outputs):
        return None
    tensors = [_tensor_at(call, s) for s in slots] + list(outputs)
    for sbp, t in zip(sbps + list(outs), tensors):
        if isinstance(sbp, Split) and not 0 <= sbp.dim < t.dim():
            return None
        if isinstance(sbp, Partial):
            try:
                check_partial_dtype(sbp, t.dtype)
            except TypeError:
                return None
    return tuple(sbps), tuple(outs)


# -- simulated ranks --------------------------------------------------------------------------------------------


def _noise(shape, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) < 0.5
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(-3, 4, shape, generator=g).to(dtype)


def _part_of(value: torch.Tensor, op: str, index: int, parts: int, seed: int) -> torch.Tensor:
    """Part ``index`` of ``parts`` random parts whose ``op``-reduction is ``value``."""
    if op == "sum":
        noise = [_noise(value.shape, value.dtype, seed * 31 + k) for k in range(parts - 1)]
        return noise[index] if index < parts - 1 else value - sum(noise, torch.zeros_like(value))
    keeper = seed % parts  # one part holds the value, the others at most (max) or at least (min) it
    if index == keeper:
        return value.clone()
    if (index + seed) % 2:  # as boxing makes a partial from a whole value: the reduction's identity elsewhere
        return torch.full_like(value, reduction_identity(op, value.dtype))
    if value.dtype == torch.bool:
        mask = _noise(value.shape, torch.bool, seed + index)
        return value & mask if op == "max" else value | mask
    bump = _noise(value.shape, value.dtype, seed + index).abs()
    return value - bump if op == "max" else value + bump


def local_part(value: torch.Tensor, meta: GlobalMeta, coord: tuple[int, ...], seed: int) -> torch.Tensor:
    """This coordinate's part of ``value`` laid out as ``meta``: partial axes decomposed (depending only on the
    coordinates along partial axes, so ranks of a broadcast or split axis agree), then the region taken."""
    part = value
    prefix = ()
    for axis, sbp in enumerate(meta.sbp):
        if isinstance(sbp, Partial):
            group_seed = hash((seed, axis, prefix)) % 2**31  # the same for every part of this group
            part = _part_of(part, sbp.op, coord[axis], meta.placement.shape[axis], group_seed)
            prefix += (coord[axis],)
    starts, lengths = meta.with_sbp(tuple(broadcast if isinstance(s, Partial) else s for s in meta.sbp)).region(coord)
    return narrow_to(part, starts, lengths).clone()


def _reduce(parts: list[torch.Tensor], op: str) -> torch.Tensor:
    stacked = torch.stack(parts)
    if op == "sum":
        return stacked.sum(0) if stacked.dtype != torch.bool else stacked.any(0)
    return stacked.amax(0) if op == "max" else stacked.amin(0)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values (NaN equal to NaN)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not (a.is_floating_point() or a.is_complex()):
        return torch.equal(a, b)
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def assemble(parts: dict, meta: GlobalMeta) -> torch.Tensor:
    """The logical tensor from every coordinate's local part under ``meta``; AssertionError where the ranks of a
    broadcast axis disagree."""
    partial_axes = [a for a, s in enumerate(meta.sbp) if isinstance(s, Partial)]
    whole = tuple(broadcast if isinstance(s, Partial) else s for s in meta.sbp)
    groups: dict = {}
    for coord, local in parts.items():
        groups.setdefault(tuple(coord[a] for a in partial_axes), []).append((coord, local))
    values = {}
    for key, members in groups.items():
        first = members[0][1]
        out = torch.empty(meta.shape, dtype=first.dtype)
        written = {}
        for coord, local in members:
            starts, lengths = meta.with_sbp(whole).region(coord)
            box = (tuple(starts), tuple(lengths))
            if box in written:
                if not _same(written[box], local):
                    raise AssertionError(f"ranks holding the same region disagree: {coord}")
                continue
            written[box] = local
            narrow_to(out, starts, lengths).copy_(local)
        values[key] = out
    if not partial_axes:
        return values[()]
    ops = {meta.sbp[a].op for a in partial_axes}
    (op,) = ops
    return _reduce(list(values.values()), op)


class _Collectives:
    """``all_reduce`` among threads that stand for the ranks: each call deposits its tensor, waits for every rank,
    reduces over the ranks that differ only along the axis, and waits again."""

    def __init__(self, coords: list[tuple[int, ...]]):
        self.barrier = threading.Barrier(len(coords), timeout=20)
        self.slots: dict = {}

    def reduce_along(self, coord, x: torch.Tensor, op: str, axis: int) -> torch.Tensor:
        self.slots[coord] = x
        self.barrier.wait()
        group = [v for c, v in self.slots.items() if c[:axis] + c[axis + 1 :] == coord[:axis] + coord[axis + 1 :]]
        out = _reduce(group, op)
        self.barrier.wait()
        return out


def _no_boxing(local, meta, sbp):
    raise NotImplementedError("the rule checker runs no boxing inside local functions")


def simulate(call: SampleCall, mesh: tuple[int, ...], combo, slots, targets, outputs, seed: int = 0) -> str | None:
    """None if the N-D signature ``combo`` (input SBPs ``targets`` per slot, output SBPs per output) gives the
    logical outputs ``outputs`` on simulated ranks of a placement shaped ``mesh``; else what went wrong."""
    placement = st.placement("cpu", torch.arange(math.prod(mesh)).reshape(mesh).tolist())
    coords = list(itertools.product(*map(range, mesh)))
    whole = call if not call.shapes_only else _on_meta(call)
    metas = {
        s: GlobalMeta(tuple(_tensor_at(call, s).shape), _tensor_at(call, s).dtype, placement, t)
        for s, t in zip(slots, targets[0])
    }
    out_metas = [GlobalMeta(tuple(o.shape), o.dtype, placement, sbp) for o, sbp in zip(outputs, targets[1])]
    local_fn = next((s.local_fn for s in combo if s.local_fn), None)
    rule = rule_for(call.func)
    collectives = _Collectives(coords)
    results, errors = {}, {}

    def run_rank(coord):
        def part(slot, t):
            if call.shapes_only:
                return torch.empty(metas[slot].local_shape(coord), dtype=t.dtype, device="meta")
            return local_part(t, metas[slot], coord, seed + slots.index(slot))

        try:
            args, kwargs = _with_tensors(whole, part)
            if local_fn is None:
                results[coord] = _run(call, args, kwargs)
                return
            ctx = LocalContext(
                placement,
                coord,
                tuple(metas[s] for s in slots),
                tuple(out_metas),
                tuple(a for a, s in enumerate(combo) if s.local_fn),
                by_name(op_schema(call.func), args, kwargs),
                lambda x, op, axis: collectives.reduce_along(coord, x, op, axis),
                _no_boxing,
            )
            out = rule.local_fns[local_fn](call.func, ctx)
            results[coord] = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        except Exception as err:  # noqa: BLE001 - reported as the finding
            errors[coord] = f"{type(err).__name__}: {err}"
            collectives.barrier.abort()

    if local_fn is None:
        for coord in coords:
            run_rank(coord)
    else:
        threads = [threading.Thread(target=run_rank, args=(c,)) for c in coords]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:
        return f"raised on rank {min(errors)}: {errors[min(errors)]}"[:300]
    for j, meta in enumerate(out_metas):
        for coord in coords:
            got = results[coord][j] if j < len(results[coord]) else None
            if got is None or tuple(got.shape) != meta.local_shape(coord):
                shape = None if got is None else tuple(got.shape)
                return f"output {j} on {coord} has shape {shape}, its layout {meta.sbp} needs {meta.local_shape(coord)}"
        if call.shapes_only or call.func in UNDEFINED_VALUES:
            continue
        try:
            logical = assemble({c: results[c][j] for c in coords}, meta)
            torch.testing.assert_close(logical, outputs[j], equal_nan=True, check_dtype=False, **TOLERANCE)
        except AssertionError as err:
            return f"output {j} ({meta.sbp}): {str(err).splitlines()[0]}"[:300]
    return None


# -- the checks ------------------------------------------------------------------------------------------------


@dataclass
class Report:
    checked: int = 0  # N-D signatures simulated
    calls: int = 0
    findings: list = field(default_factory=list)
    rules: set = field(default_factory=set)  # the rules checked, by their function's name


def _combos(one_d: list, mesh: tuple[int, ...], all_broadcast):
    """The N-D signatures to check: each 1-D one on a 1-D mesh; on a 2-D mesh each one beside itself and beside
    the all-broadcast one, on either axis."""
    if len(mesh) == 1:
        return [(s,) for s in one_d]
    combos = []
    for s in one_d:
        for combo in ((s, s), (s, all_broadcast), (all_broadcast, s)):
            if combo not in combos:
                combos.append(combo)
    return combos


def _same_partial_kind(targets) -> bool:
    """The checker decomposes several partial axes of one tensor only with one reduction."""
    return all(len({s.op for s in sbp if isinstance(s, Partial)}) <= 1 for sbp in targets)


def check_call(call: SampleCall, mesh: tuple[int, ...], report: Report) -> None:
    """Simulate every signature the call's rule offers on a placement shaped ``mesh``; findings go to ``report``."""
    rule = rule_for(call.func)
    outputs = expected_outputs(call)
    op_call = shown_call(call, mesh, outputs)
    slots = tensor_slots(call)
    report.calls += 1
    report.rules.add(rule.signatures.__name__)
    one_d = []
    for signature in rule.offered(op_call):
        if resolved(signature, slots, call, outputs) is not None:
            one_d.append(signature)
    all_broadcast = next((s for s in one_d if all(x == broadcast for x in resolved(s, slots, call, outputs)[0])), None)
    for combo in _combos(one_d, mesh, all_broadcast or one_d[0]):
        if len({s.local_fn for s in combo if s.local_fn}) > 1:
            continue
        if rule.check_nd is not None and not rule.check_nd(op_call, combo):
            continue
        per_axis = [resolved(s, slots, call, outputs) for s in combo]
        targets = (
            tuple(tuple(axis[0][i] for axis in per_axis) for i in range(len(slots))),
            tuple(tuple(axis[1][j] for axis in per_axis) for j in range(len(outputs))),
        )
        if not (_same_partial_kind(targets[0]) and _same_partial_kind(targets[1])):
            continue
        report.checked += 1
        problem = simulate(call, mesh, combo, slots, targets, outputs)
        if problem is not None:
            report.findings.append(Finding(call, mesh, combo, problem))


def check_rules(calls: list[SampleCall], meshes=None) -> Report:
    report = Report()
    for call in calls:
        for mesh in meshes or PLACEMENTS.values():
            try:
                check_call(call, mesh, report)
            except Exception as err:  # noqa: BLE001 - the rule or the expected op failed outright
                report.findings.append(Finding(call, mesh, (), f"{type(err).__name__}: {err}"[:300]))
    return report


# -- missing signatures -----------------------------------------------------------------------------------------


def _candidates(t: torch.Tensor) -> list:
    kinds = [Split(d) for d in range(t.dim())] + [broadcast]
    for p in PARTIALS:
        try:
            check_partial_dtype(p, t.dtype)
            kinds.append(p)
        except TypeError:
            pass
    return kinds


def _fitting_layout(parts: dict, out: torch.Tensor, placement) -> list:
    """Every 1-D layout under which the two local parts ``parts`` form ``out``."""
    fits = []
    for sbp in _candidates(out):
        meta = GlobalMeta(tuple(out.shape), out.dtype, placement, (sbp,))
        if any(tuple(local.shape) != meta.local_shape(c) for c, local in parts.items()):
            continue
        try:
            torch.testing.assert_close(assemble(parts, meta), out, equal_nan=True, check_dtype=False, **TOLERANCE)
        except AssertionError:
            continue
        fits.append(sbp)
    return fits


def missing_signatures(call: SampleCall, max_inputs: int = 3) -> list[str]:
    """Input layouts on two ranks (other than all-broadcast) under which the op's local outputs form a layout of its
    logical outputs, and which the rule does not offer with such an output layout."""
    slots = tensor_slots(call)
    if not slots or len(slots) > max_inputs or call.shapes_only or call.func in UNDEFINED_VALUES:
        return []
    outputs = expected_outputs(call)
    if not outputs:
        return []
    placement = st.placement("cpu", [0, 1])
    op_call = shown_call(call, (2,), outputs)
    offered = set()
    for signature in rule_for(call.func).offered(op_call):
        r = resolved(signature, slots, call, outputs)
        if r is not None and not signature.local_fn:
            offered.add(r)
    missing = []
    tensors = [_tensor_at(call, s) for s in slots]
    for layout in itertools.product(*map(_candidates, tensors)):
        if all(s == broadcast for s in layout):
            continue
        metas = {s: GlobalMeta(tuple(t.shape), t.dtype, placement, (sbp,)) for s, t, sbp in zip(slots, tensors, layout)}
        parts = {}
        try:
            for coord in ((0,), (1,)):
                args, kwargs = _with_tensors(call, lambda slot, t: local_part(t, metas[slot], coord, slots.index(slot)))
                parts[coord] = _run(call, args, kwargs)
        except Exception:  # noqa: BLE001 - the op does not run on these parts
            continue
        if any(len(p) != len(outputs) for p in parts.values()):
            continue
        fits = [_fitting_layout({c: parts[c][j] for c in parts}, o, placement) for j, o in enumerate(outputs)]
        if not all(fits):
            continue
        if not any(
            (layout, tuple((s,) for s in outs)) in offered or (layout, outs) in offered
            for outs in itertools.product(*fits)
        ):
            missing.append(f"{call}: {layout} -> {[f[0] for f in fits]}")
    return missing


def _main() -> None:
    import argparse
    import time

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--missing", action="store_true", help="also search for valid signatures the rules miss")
    parser.add_argument("--ops", nargs="*", help="OpInfo names to sample (default: all)")
    parser.add_argument("--per-op", type=int, default=3)
    args = parser.parse_args()
    start = time.perf_counter()
    calls = sample_calls(args.per_op, names=set(args.ops) if args.ops else None)
    calls += attention_calls() + other_calls() + kernel_calls()
    sampled = time.perf_counter()
    report = check_rules(calls)
    checked = time.perf_counter()
    print(
        f"{report.calls} call checks of {len(calls)} calls ({len({c.func for c in calls})} ops, "
        f"{len(report.rules)} rules), {report.checked} N-D signatures simulated; "
        f"sampling {sampled - start:.1f} s, checking {checked - sampled:.1f} s"
    )
    print(f"{len(report.findings)} wrong:")
    for finding in report.findings:
        print("  ", finding)
    if args.missing:
        print("missing:", flush=True)
        found = 0
        for call in calls:
            for m in missing_signatures(call):
                found += 1
                print("  ", m, flush=True)
        print(f"{found} missing ({time.perf_counter() - checked:.1f} s)")


def attention_calls() -> list[SampleCall]:
    """Calls of CUDA's fused attention kernels, forward and backward, checked on meta tensors (shapes only):
    heads split evenly and unevenly, grouped-query attention, an additive mask."""
    calls = []
    for batch, heads, key_heads, length in ((3, 4, 4, 5), (2, 6, 2, 7), (5, 3, 3, 4)):
        q = torch.empty(batch, heads, length, 8, device="meta")
        kv = torch.empty(batch, key_heads, length + 1, 8, device="meta")
        mask = torch.empty(batch, 1, length, length + 1, device="meta")
        grad_out, out, lse = torch.empty_like(q), torch.empty_like(q), torch.empty(batch, heads, 32, device="meta")
        seed, offset = (
            torch.empty((), dtype=torch.int64, device="meta"),
            torch.empty((), dtype=torch.int64, device="meta"),
        )
        calls += [
            SampleCall(aten._scaled_dot_product_efficient_attention.default, (q, kv, kv, mask, True), {}, True),
            SampleCall(
                aten._scaled_dot_product_efficient_attention_backward.default,
                (grad_out, q, kv, kv, mask, out, lse, seed, offset, 0.0, [True, True, True, True]),
                {},
                True,
            ),
        ]
        if key_heads == heads:
            calls.append(SampleCall(aten._scaled_dot_product_flash_attention.default, (q, kv, kv), {}, True))
            cum = torch.empty(0, dtype=torch.int32, device="meta")
            calls.append(
                SampleCall(
                    aten._scaled_dot_product_flash_attention_backward.default,
                    (
                        grad_out,
                        q,
                        kv,
                        kv,
                        out,
                        lse[..., :length],
                        cum,
                        cum,
                        length,
                        length + 1,
                        0.0,
                        False,
                        seed,
                        offset,
                    ),
                    {},
                    True,
                )
            )
    return calls


def other_calls() -> list[SampleCall]:
    """Calls that reach the dispatcher only through sbp_torch's own frontend: ``aten.matmul`` of same-batch tensors
    (``_frontend/_batched_matmul.py``), and foreach ops index by index (one-element lists,
    ``_dispatch/_foreach.py``); and calls with numbers where OpInfo's samples pass tensors."""
    x, y = torch.randn(3, 5, 4, dtype=torch.float64), torch.randn(3, 4, 7, dtype=torch.float64)
    a, b = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    return [
        SampleCall(aten.matmul.default, (x, y), {}),
        SampleCall(aten._foreach_add.List, ([a], [b]), {"alpha": 0.5}),
        SampleCall(aten._foreach_mul.Scalar, ([a], 0.1), {}),
        SampleCall(aten._foreach_addcmul.Scalar, ([a], [b], [a]), {"value": 2.0}),
        SampleCall(aten._foreach_neg.default, ([a],), {}),
        SampleCall(aten._foreach_mul.Tensor, ([a], torch.tensor(3.0, dtype=torch.float64)), {}),
        SampleCall(aten._foreach_div.Scalar, ([a], 4.0), {}),
        SampleCall(aten._foreach_mul.ScalarList, ([a], [0.5]), {}),
        # numbers in a tensor's place, as Python code reaches them (x * 2.0, x / 4.0, x + y * 3)
        SampleCall(aten.mul.Tensor, (a, 2.0), {}),
        SampleCall(aten.div.Tensor, (a, 4.0), {}),
        SampleCall(aten.add.Tensor, (a, b), {"alpha": 3.0}),
    ]


def kernel_calls() -> list[SampleCall]:
    """Calls of sbp_torch's fused ops (``sbp_torch.kernels``) and their backward ops, run by their CPU references
    (bias_dropout_add draws random numbers: checked in tests/test_kernels.py)."""
    import sbp_torch.kernels  # noqa: F401  (registers the ops and their rules)

    ops = torch.ops.sbp_torch
    g = torch.Generator().manual_seed(3)
    x, h = torch.randn(5, 3, 6, generator=g, dtype=torch.float64), torch.randn(6, generator=g, dtype=torch.float64)
    grad, mask = torch.randn(5, 3, 6, generator=g, dtype=torch.float64), torch.rand(3, 6, generator=g) < 0.3
    logits, target = torch.randn(7, 9, generator=g, dtype=torch.float64), torch.randint(0, 9, (7,), generator=g)
    y = torch.softmax(x, -1)
    _, mean, rstd = ops.layer_norm(x, h, h, 1e-5)
    _, rms = ops.rms_norm(x, h, 1e-6)
    lse = logits.logsumexp(-1)
    calls = [
        SampleCall(ops.bias_gelu.default, (x, h, "tanh"), {}),
        SampleCall(ops.bias_gelu_backward.default, (grad, x, h, "tanh"), {}),
        SampleCall(ops.scale_mask_softmax.default, (x, mask, 0.5, False), {}),
        SampleCall(ops.scale_mask_softmax.default, (x[:, :, :3], None, 1.0, True), {}),
        SampleCall(ops.scale_mask_softmax_backward.default, (grad, y, 0.5), {}),
        SampleCall(ops.layer_norm.default, (x, h, h, 1e-5), {}),
        SampleCall(ops.layer_norm_backward.default, (grad, x, h, mean, rstd), {}),
        SampleCall(ops.rms_norm.default, (x, h, 1e-6), {}),
        SampleCall(ops.rms_norm_backward.default, (grad, x, h, rms), {}),
        SampleCall(ops.bias_dropout_add_backward.default, (grad, mask.expand(5, 3, 6).contiguous(), 2.0), {}),
    ]
    for reduction in (0, 1, 2):
        weight = (
            torch.randn(7, generator=g, dtype=torch.float64) if reduction == 0 else torch.tensor(0.7, dtype=x.dtype)
        )
        calls += [
            SampleCall(ops.cross_entropy.default, (logits, target, -100, reduction), {}),
            SampleCall(ops.cross_entropy_backward.default, (weight, logits, target, lse, -100, reduction), {}),
        ]
    return calls


if __name__ == "__main__":
    _main()
