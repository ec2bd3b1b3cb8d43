"""Random programs on global tensors, compiled, against the same programs on plain tensors in one process.

Each program is a random chain of element-wise ops, a matrix product, softmax, a transpose, a reduction, a
``to_global`` to another SBP and routing steps whose result depends on the values (top-k, sorting, rows scattered by
an index computed from the data, a mask), ending in a loss; its inputs have random uneven shapes and random SBPs
(partial included) on a 3-rank line or a 2x2 mesh. It is compiled with ``aot_eager`` and with ``inductor`` and
called three times: a layout, the same again, other SBPs (and for odd seeds other shapes). It also runs as a
training step through ``compile_step`` (the weight a parameter, SGD): four calls, the first eager, the second
traced, the third the same program on a batch that routes otherwise, the fourth another layout of the batch.
Every call draws new values, so a routing the trace kept would give wrong numbers. Each call, forward and backward
(and the parameter after the step), must give the numbers of one process on every rank, or raise on every rank (a
call whose one-process result is not finite is skipped: an overflow's infinities and NaNs depend on the order of the
sums, which a layout changes); a
rank that dies (an abort) or a world that stops answering (a hang) is a failure. ``test_compile.py`` runs a few
programs; the whole fuzz is a command:

    python tests/compile_fuzz.py --programs 100 --seed 0

(it prints the counts; ``--programs`` per world, both worlds; on 2 cores about 10 s a program on the line, 25 s on
the mesh).
"""

from __future__ import annotations

import argparse
import collections
import itertools
import random
import sys
import time

import torch
import torch._dynamo
import torch._inductor.config

import sbp_torch as st
from sbp_torch.sbp import broadcast as B
from sbp_torch.sbp import partial_sum as P
from sbp_torch.sbp import split as S

from op_check import layout

WORLDS = {"line": (3, [0, 1, 2]), "mesh": (4, [[0, 1], [2, 3]])}
BACKENDS = ("aot_eager", "inductor", "compile_step")
INPUT_SBPS = [B, P, S(0), S(1)]
MOVE_SBPS = [B, S(0), S(1)]  # to_global inside a program: to a partial would change the value
STEPS = ["tanh", "affine", "square", "relu", "softmax", "transpose", "move", "matmul"]
ROUTING = ["top-k", "sort", "route", "mask"]  # steps whose result depends on which entries the values pick


def draw_routing(seed: int, steps: list[str]) -> list[str]:
    """``steps`` with 0-2 routing steps put in, drawn from a generator of their own, so that the rest of a
    program's draws (which the seeds of earlier failures name) stay as they were."""
    rng = random.Random(f"routing {seed}")
    steps = list(steps)
    for _ in range(rng.randint(0, 2)):
        steps.insert(rng.randint(0, len(steps)), rng.choice(ROUTING))
    return steps


def draw_program(rng: random.Random) -> list[str]:
    """A chain of 2-5 steps; the matrix product at most once. The chain always ends in a reduction (the loss)."""
    steps = [rng.choice(STEPS) for _ in range(rng.randint(2, 5))]
    return [s for i, s in enumerate(steps) if s != "matmul" or "matmul" not in steps[:i]]


def draw_sbp(rng: random.Random, ndim: int, choices) -> tuple:
    return tuple(rng.choice(choices) for _ in range(ndim))


def make_program(steps: list[str], move_sbps: list[tuple], reduce_dim: int):
    """``program(x, w)`` for the chain ``steps``; ``move_sbps`` are the targets of its ``to_global`` steps, in
    order (ignored on plain tensors, where the step is the identity)."""

    def program(x, w):
        h, moves = x, iter(move_sbps)
        for step in steps:
            if step == "tanh":
                h = torch.tanh(h)
            elif step == "affine":
                h = h * 1.5 - 0.25
            elif step == "square":
                h = h * h
            elif step == "relu":
                h = torch.relu(h) + 0.1
            elif step == "softmax":
                h = h.softmax(dim=-1)
            elif step == "transpose":
                h = h.t()
            elif step == "move":
                sbp = next(moves)
                h = h.to_global(sbp=sbp) if h.is_global else h
            elif step == "matmul":
                h = h @ w if h.shape[-1] == w.shape[0] else h.t() @ w
            elif step == "top-k":  # each row keeps its two largest entries
                kept = h.topk(min(2, h.shape[-1]), dim=-1).indices
                h = torch.zeros_like(h).scatter(-1, kept, h.gather(-1, kept))
            elif step == "sort":
                h = h.sort(dim=-1).values.cumsum(-1)
            elif step == "route":  # each row added into the row its largest entry names, as tokens to experts
                h = torch.zeros_like(h).index_add(0, h.argmax(-1) % h.shape[0], h)
            elif step == "mask":
                h = h.masked_fill(h < 0, 0.0) + torch.where(h > 0.5, h, -h) * 0.25
        return h.sum(reduce_dim).pow(2).mean() + (w * 0.5).sum()

    return program


def run_program(seed: int, world: str, backends: tuple[str, ...] = BACKENDS, routing: bool = True) -> list[tuple]:
    """Program ``seed`` on this rank, with each of ``backends`` (three calls each, four as a ``compile_step``): a list
    of (backend, call, outcome), where outcome is "match", "wrong" or "raised <type>". ``routing``: with the routing
    steps of ``draw_routing`` (without: the programs seeds drew before there were any)."""
    rng = random.Random(seed)
    p = st.placement("cpu", WORLDS[world][1])
    steps = draw_program(rng)
    move_sbps = [draw_sbp(rng, p.ndim, MOVE_SBPS) for _ in steps]
    if routing:
        steps = draw_routing(seed, steps)
    reduce_dim = rng.randint(0, 1)
    shapes = [(rng.randint(1, 7), rng.randint(1, 7), rng.randint(1, 7)) for _ in range(2)]
    layouts = [(draw_sbp(rng, p.ndim, INPUT_SBPS), draw_sbp(rng, p.ndim, INPUT_SBPS)) for _ in range(2)]
    # again (the compiled program is reused), then other SBPs (a recompile), with other shapes for odd seeds
    calls = [(shapes[0], layouts[0]), (shapes[0], layouts[0]), (shapes[seed % 2], layouts[1])]
    program = make_program(steps, move_sbps, reduce_dim)
    outcomes = []
    torch._inductor.config.compile_threads = 1  # (no compile workers: the ranks share the cores)
    for backend in backends:
        if backend == "compile_step":
            outcomes += _as_step(program, p, seed, shapes[0], [layouts[0][0]] * 3 + [layouts[1][0]], layouts[0][1])
        else:
            torch._dynamo.reset()
            compiled = torch.compile(program, backend=backend, fullgraph=True)
            for index, ((m, n, k), (x_sbp, w_sbp)) in enumerate(calls):
                gen = torch.Generator().manual_seed(seed * 10 + index)
                X, W = torch.randn(m, n, generator=gen), torch.randn(n, k, generator=gen)
                outcomes.append((backend, index, _call(compiled, program, X, W, p, x_sbp, w_sbp)))
                if outcomes[-1][2].startswith("raised"):
                    return outcomes  # the world may be out of step or closed: the driver starts a fresh one
        if outcomes and outcomes[-1][2].startswith("raised"):
            return outcomes
    return outcomes


class _Weight(torch.nn.Module):
    def __init__(self, w: torch.Tensor):
        super().__init__()
        self.w = torch.nn.Parameter(w)


def _as_step(program, p, seed: int, shape, x_sbps: list, w_sbp) -> list[tuple]:
    """``program`` as an SGD training step through ``compile_step``, its weight a parameter laid out as ``w_sbp``,
    one call per batch layout of ``x_sbps`` (new values each): per call, whether the loss and the updated weight
    are one process's."""
    import sbp_torch as st_

    m, n, k = shape
    gen = torch.Generator().manual_seed(seed * 10)
    reference = _Weight(torch.randn(n, k, generator=gen))
    model = _Weight(reference.w.detach().clone()).to_global(p, {"w": w_sbp})
    ref_opt, optimizer = (torch.optim.SGD(m_.parameters(), lr=0.1) for m_ in (reference, model))

    def step(x):
        loss = program(x, model.w)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss

    compiled = st_.compile_step(step, model=model, optimizer=optimizer, backend="inductor")
    outcomes = []
    for index, x_sbp in enumerate(x_sbps):
        X = torch.randn(m, n, generator=gen)
        try:
            want = program(X, reference.w)
            ref_opt.zero_grad()
            want.backward()
            ref_opt.step()
        except RuntimeError:  # the chain does not fit these shapes in one process either
            outcomes.append(("compile_step", index, "skipped"))
            break
        if not _finite(want, reference.w):  # (every rank alike: the one-process run is the same on each)
            outcomes.append(("compile_step", index, "skipped"))
            break
        try:
            loss = compiled(layout(X, p, x_sbp))
            got = [loss.full_tensor(), model.w.full_tensor()]
        except Exception as err:  # noqa: BLE001 - every error counts; the driver checks all ranks raised
            outcomes.append(("compile_step", index, f"raised {type(err).__name__}: {str(err).splitlines()[0][:200]}"))
            break
        close = all(torch.allclose(g, r, rtol=1e-4, atol=1e-4) for g, r in zip(got, [want.detach(), reference.w]))
        outcomes.append(("compile_step", index, "match" if close else "wrong"))
    return outcomes


def _finite(*tensors) -> bool:
    """Whether one process's results are finite: an infinity or NaN (a chain that overflows, as SGD on squares of
    squares does) depends on the order the sums ran in, which a layout changes, so there is nothing to compare."""
    return all(bool(torch.isfinite(t.detach()).all()) for t in tensors)


def _call(compiled, program, X, W, p, x_sbp, w_sbp) -> str:
    x_ref, w_ref = X.clone().requires_grad_(), W.clone().requires_grad_()
    try:
        want = program(x_ref, w_ref)
        want.backward()
    except RuntimeError:  # the chain does not fit these shapes in one process either
        return "skipped"
    if not _finite(want, x_ref.grad, w_ref.grad):
        return "skipped"
    try:
        x = layout(X, p, x_sbp).detach().requires_grad_()
        w = layout(W, p, w_sbp).detach().requires_grad_()
        loss = compiled(x, w)
        loss.backward()
        got = [loss.full_tensor().detach(), x.grad.full_tensor(), w.grad.full_tensor()]
    except Exception as err:  # noqa: BLE001 - every error counts; the driver checks all ranks raised
        return f"raised {type(err).__name__}: {str(err).splitlines()[0][:200]}"
    close = all(
        torch.allclose(g, r, rtol=1e-4, atol=1e-4) for g, r in zip(got, [want.detach(), x_ref.grad, w_ref.grad])
    )
    return "match" if close else "wrong"


def fuzz(programs: int, seed: int, batch: int = 4, timeout: float = 300.0) -> dict:
    """Run ``programs`` programs on each world; returns the counts (and the failures, described). After a call
    that raised on some rank, the world is started afresh and the next program runs there."""
    import world as harness

    counts, failures, raised = collections.Counter(), [], collections.Counter()
    for name, (size, _) in WORLDS.items():
        seeds = list(range(seed, seed + programs))
        while seeds:
            try:
                per_rank = harness.run_on_world(size, run_batch, seeds[:batch], name, _timeout=timeout)
            except harness.RankFailure as err:
                kind = "hangs" if err.missing else "aborts"
                counts[kind] += 1
                failures.append(f"{name} seeds {seeds[:batch]}: {kind}\n{str(err)[:3000]}")
                seeds = seeds[batch:]
                continue
            done = max(len(results) for results in per_rank)
            for s, outcomes in zip(seeds, zip(*(r + [[]] * (done - len(r)) for r in per_rank))):
                counts["programs"] += 1
                for calls in itertools.zip_longest(*outcomes, fillvalue=(None, None, "stopped")):
                    _count(counts, failures, raised, f"{name} seed {s} {calls[0][:2]}", calls)
            if any(o[2].startswith("raised") for results in per_rank for outcomes in results for o in outcomes):
                harness._worlds[size].kill()  # (its ranks may be out of step)
            seeds = seeds[done:]
            print(f"{name} up to seed {s}: {dict(counts)}", file=sys.stderr, flush=True)
    return {"counts": dict(counts), "failures": failures, "raised": dict(raised)}


_COLLECTIVE_FAILED = ("Timed out", "Connection closed", "Connection reset", "closed its process groups")


def _count(counts, failures, raised, where: str, calls: tuple) -> None:
    """Classify one call from every rank's outcome."""
    counts["calls"] += 1
    kinds = {o[2] if not o[2].startswith("raised") else "raised" for o in calls}
    if kinds == {"match"}:
        counts["matches"] += 1
    elif kinds == {"skipped"}:
        counts["skipped (no plain result)"] += 1
    elif kinds == {"raised"} and not any(text in o[2] for o in calls for text in _COLLECTIVE_FAILED):
        counts["raises everywhere"] += 1
        raised[calls[0][2][:160]] += 1
    else:  # wrong numbers, ranks that disagree, or collectives that waited until their timeout
        counts["wrong, divergent or timed out"] += 1
        failures.append(f"{where}: " + "; ".join(o[2][:300] for o in calls))


def run_batch(seeds: list[int], world: str) -> list[list[tuple]]:
    """Each program of ``seeds`` (see ``run_program``); stops after a program in which a call raised here."""
    results = []
    for s in seeds:
        results.append(run_program(s, world))
        if results[-1][-1][2].startswith("raised"):
            break
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", type=int, default=200, help="programs per world")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    started = time.monotonic()
    import compile_fuzz  # (the workers find the functions by this module's name, not "__main__")

    result = compile_fuzz.fuzz(args.programs, args.seed)
    for failure in result["failures"]:
        print(failure, "\n")
    for message, n in result["raised"].items():
        print(f"raised on every rank ({n}): {message}")
    print(f"torch {torch.__version__}, seed {args.seed}, {time.monotonic() - started:.0f} s: {result['counts']}")
    sys.exit(1 if result["failures"] else 0)


if __name__ == "__main__":
    main()
