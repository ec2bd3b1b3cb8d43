"""``sbp_torch.compile_step`` gives the single-process training, step after step.

Each job trains the same model twice: on plain tensors in one process, and laid out on 2 ranks with the whole
step (batch layout, forward, backward, optimizer step) given to ``compile_step``; losses and final parameters
must agree. Most use ``backend=None``, which runs the traced graph as traced, so a wrong trace shows as a wrong
number; one uses Inductor. Other jobs change what the program is traced for (batch shape, hyperparameters,
state replaced outside the step) and check the retrace, or break the rules and check the error on every rank."""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import inspect

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st_
from torch import nn

import sbp_torch as st
import sbp_torch._api._compile_step as compile_step_module
from sbp_torch.sbp import broadcast as B
from sbp_torch.sbp import split as S
from zoo.gpt import load_example

from world import run_on_world

pytestmark = pytest.mark.gloo


class MLP(nn.Module):
    def __init__(self, inner: int, hidden: int):
        super().__init__()
        self.up = nn.Linear(inner, hidden)
        self.down = nn.Linear(hidden, inner)

    def forward(self, x):
        return (self.down(torch.relu(self.up(x))) + 1.0).pow(2).mean()


def _batches(count: int, rows: int, inner: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, inner, generator=gen) for _ in range(count)]


def _plain_steps(model, optimizer, batches, scheduler=None) -> list[float]:
    losses = []
    for x in batches:
        loss = model(x)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return losses


def _global_step(model, optimizer, placement, batch_sbp, backend):
    whole = (B,) * placement.ndim

    @st.compile_step(model=model, optimizer=optimizer, backend=backend)
    def step(x):
        loss = model(x.to_global(placement, whole, check_meta=False).to_global(sbp=batch_sbp))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss

    return step


def _assert_params_match(model, reference, rtol=1e-5, atol=1e-6):
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(got.full_tensor(), want.detach(), rtol=rtol, atol=atol, msg=name)


def _mlp_training(plan, inner, hidden, rows, backend, make_optimizer, steps=5):
    """Train the MLP laid out by ``plan`` for ``steps`` steps through ``compile_step``; compare with one process."""
    torch.manual_seed(0)
    reference = MLP(inner, hidden)
    model = copy.deepcopy(reference)
    placement = st.placement("cpu", [0, 1])
    model.to_global(placement, plan)
    batches = _batches(steps, rows, inner)
    ref_opt = make_optimizer(reference)
    want = _plain_steps(reference, ref_opt, batches)
    optimizer = make_optimizer(model)
    step = _global_step(model, optimizer, placement, S(0), backend)
    got = [step(x).item() for x in batches]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    _assert_params_match(model, reference)
    return step.traces


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=5e-2, momentum=0.9)


_SBPS = st_.sampled_from([B, S(0), S(1)])


def _random_layouts(data, inner, hidden, rows, optimizer):
    plan = {
        "up.weight": data[0],
        "up.bias": S(0) if data[1] is not B else B,
        "down.weight": data[2],
        "down.bias": B,
    }
    return _mlp_training(plan, inner, hidden, rows, None, _adamw if optimizer == "adamw" else _sgd)


@settings(max_examples=6, deadline=None)
@given(
    sbps=st_.tuples(_SBPS, _SBPS, _SBPS),
    inner=st_.integers(1, 7),
    hidden=st_.integers(1, 9),
    rows=st_.integers(2, 9),
    optimizer=st_.sampled_from(["adamw", "sgd"]),
)
def test_random_layouts_match_one_process(sbps, inner, hidden, rows, optimizer):
    """Random layouts of the parameters (uneven splits, parts of size 0), random batch rows, AdamW or SGD."""
    traces = run_on_world(2, _random_layouts, sbps, inner, hidden, rows, optimizer)
    assert traces == [1, 1]


def test_inductor_program_matches_one_process():
    plan = {"up.weight": S(0), "up.bias": S(0), "down.weight": S(1)}
    assert run_on_world(2, _mlp_training, plan, 6, 10, 5, "inductor", _adamw, _timeout=300) == [1, 1]


class CachedAttention(nn.Module):
    """Keys as a ``transformers`` attention builds them: heads split from a projection (a transposed view), joined
    to an empty cache by ``cat``, then multiplied transposed. torch's ``cat`` gives a contiguous tensor; Inductor's
    decomposition of it keeps the non-contiguous keys' strides, so a trace made without Inductor's decompositions
    recorded a ``view`` that Inductor then refused."""

    def __init__(self, width=8, heads=2):
        super().__init__()
        self.heads = heads
        self.key = nn.Linear(width, width)

    def forward(self, x):
        rows, seq, width = x.shape
        k = self.key(x).view(rows, seq, self.heads, width // self.heads).transpose(1, 2)
        k = torch.cat([k.new_zeros(rows, self.heads, 0, width // self.heads), k * 2], dim=-2)
        q = x.view(rows, seq, self.heads, width // self.heads).transpose(1, 2)
        return (q @ k.transpose(-2, -1)).softmax(-1).pow(2).mean()


def _cached_attention():
    torch.manual_seed(0)
    reference = CachedAttention()
    model = copy.deepcopy(reference).to_global(st.placement("cpu", [0, 1]), B)
    ref_opt, optimizer = _adamw(reference), _adamw(model)
    step = _global_step(model, optimizer, model.key.weight.placement, S(0), "inductor")
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(4, 5, 8, generator=gen)
        want = reference(x)
        ref_opt.zero_grad()
        want.backward()
        ref_opt.step()
        torch.testing.assert_close(step(x).full_tensor().item(), want.item(), rtol=1e-5, atol=1e-6)
    return step.traces


def test_inductor_traces_with_its_own_decompositions():
    assert run_on_world(2, _cached_attention, _timeout=300) == [1, 1]


@contextlib.contextmanager
def _programs_seen():
    """The collectives of each program ``compile_step`` hands its backend while the block runs (op -> count)."""
    programs = []
    handed = compile_step_module._compiled

    def seen(backend, gm):
        programs.append(collections.Counter(n.target for n in gm.graph.nodes if "_c10d_functional" in str(n.target)))
        return handed(backend, gm)

    compile_step_module._compiled = seen
    try:
        yield programs
    finally:
        compile_step_module._compiled = handed


def _gpt_training(mode):
    gpt = load_example()
    torch.manual_seed(0)
    reference = gpt.GPT()
    model = copy.deepcopy(reference)
    line = st.placement("cpu", [0, 1])
    placement, plan, batch_sbp = {"dp": (line, B, S(0)), "tp": (line, gpt.TENSOR_PARALLEL, B)}[mode]
    model.to_global(placement, plan)
    batches = list(gpt.batches(5))
    ref_opt = gpt.make_optimizer(reference)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, 2, 0.5)
    want = []
    for idx, targets in batches:
        want.append(gpt.train_step(reference, ref_opt, idx, targets))
        ref_sched.step()
    optimizer = gpt.make_optimizer(model)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5)
    whole = (B,) * placement.ndim
    layout = lambda t: t.to_global(placement, whole, check_meta=False).to_global(sbp=batch_sbp)  # noqa: E731
    step = st.compile_step(
        functools.partial(gpt.step_loss, model, optimizer, layout=layout),
        model=model,
        optimizer=optimizer,
        backend=None,
    )
    got = []
    with _programs_seen() as programs:
        for idx, targets in batches:
            got.append(step(idx, targets).item())
            scheduler.step()  # the learning rate halves every 2 steps: read per call, no new trace
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # AdamW divides each gradient by its own size, so rounding noise in gradients near zero (a key's bias, which
    # softmax ignores) moves parameters by up to 7e-5 after 5 steps here: as much in eager sbp_torch's tensor
    # parallelism as in this program's.
    _assert_params_match(model, reference, atol=2e-4)
    all_reduces = programs[0][torch.ops._c10d_functional.all_reduce.default]
    return step.traces, all_reduces, len(list(model.parameters()))


@pytest.mark.parametrize("mode", ["dp", "tp"])
def test_gpt_example_matches_one_process(mode):
    for traces, all_reduces, parameters in run_on_world(2, _gpt_training, mode, _timeout=300):
        assert traces == 1
        if mode == "dp":  # the gradients reduced in one bucket, as eagerly, beside the loss's reductions
            assert all_reduces <= 3 < parameters


def _retraces():
    """What the program is traced for changes: each change traces again and stays right."""
    torch.manual_seed(0)
    reference = MLP(5, 6)
    model = copy.deepcopy(reference)
    placement = st.placement("cpu", [0, 1])
    model.to_global(placement, {"up.weight": S(0), "down.weight": S(1)})
    ref_opt, optimizer = _adamw(reference), _adamw(model)
    whole = (B,)

    @st.compile_step(model=model, optimizer=optimizer, backend=None)
    def step(x, scale):  # no zero_grad inside: the caller's set_to_none empties the gradients' holders
        loss = model(x.to_global(placement, whole, check_meta=False).to_global(sbp=(S(0),))) * scale
        loss.backward()
        optimizer.step()
        return {"loss": loss}

    traces = []
    cases = [(4, 1.0), (4, 1.0), (4, 1.0), (7, 1.0), (7, 1.0), (4, 2.0), (4, 2.0)]
    for i, (rows, scale) in enumerate(cases):
        if i == 5:  # a hyperparameter that is part of the key
            for group in (*ref_opt.param_groups, *optimizer.param_groups):
                group["weight_decay"] = 0.5
        (x,) = _batches(1, rows, 5, seed=i)
        want = model_loss = reference(x) * scale
        model_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        got = step(x, scale)["loss"]
        torch.testing.assert_close(got.item(), want.item(), rtol=1e-5, atol=1e-6)
        _assert_params_match(model, reference)
        # the step left gradients as eager backward would
        assert all(p.grad is not None for p in model.parameters())
        optimizer.zero_grad()
        traces.append(step.traces)
    # a loaded optimizer state is held by other tensors: traced again, and right
    optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    (x,) = _batches(1, 4, 5, seed=99)
    want = reference(x) * 2.0
    want.backward()
    ref_opt.step()
    torch.testing.assert_close(step(x, 2.0)["loss"].item(), want.item(), rtol=1e-5, atol=1e-6)
    _assert_params_match(model, reference)
    traces.append(step.traces)
    model.eval()  # a module's training flag is in the key (dropout, batch norm read it)
    step(x, 2.0)
    assert not step.peers_in_key  # (laid out unchecked, as alike on every rank: nothing is exchanged per call)
    return traces + [step.traces]


def test_retraces_when_its_key_or_state_changes():
    # first call eager (0); the second traces (1); new rows (2); new scale (3, a value argument) with a new
    # weight decay; a loaded optimizer state: other tensors of the same forms, run without a new trace (3); eval
    # mode (4)
    assert run_on_world(2, _retraces) == [[0, 1, 1, 2, 2, 3, 3, 3, 4]] * 2


def _rows_changing_on_one_rank():
    """Each rank lays out its own rows of the batch inside the step, and the rows change on one rank at a time: a
    program laid out for one pair of row counts must not run for another (the loss is a mean over all rows). The
    rows come as the part's shape, then as a number the step cuts the part to."""
    torch.manual_seed(0)
    reference = MLP(5, 6)
    model = copy.deepcopy(reference)
    placement = st.placement("cpu", [0, 1])
    model.to_global(placement, {"up.weight": S(0)})
    ref_opt, optimizer = _adamw(reference), _adamw(model)

    @st.compile_step(model=model, optimizer=optimizer, backend=None)
    def step(part, rows):
        loss = model(part[:rows].to_global(placement, (S(0),)))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss

    nested = torch.compile(lambda part, rows: step(part, rows), backend="eager")  # (the step runs as it is)
    traces, me = [], dist.get_rank()
    cases = [(3, 3), (3, 3), (5, 5), (3, 5), (5, 3)] + [(3, 3, "count"), (5, 5, "count"), (3, 5, "count")] * 2
    for i, case in enumerate(cases):
        rows, by_count = case[:2], len(case) > 2
        parts = [x[:n] for x, n in zip(_batches(2, 5, 5, seed=i), rows)]
        want = reference(torch.cat(parts))
        ref_opt.zero_grad()
        want.backward()
        ref_opt.step()
        call = nested if i == len(cases) - 1 else step
        got = call(_batches(2, 5, 5, seed=i)[me], rows[me]) if by_count else call(parts[me], 5)
        torch.testing.assert_close(got.item(), want.item(), rtol=1e-5, atol=1e-6, msg=str(cases[i]))
        _assert_params_match(model, reference)
        traces.append(step.traces)
    assert step.peers_in_key  # (the other ranks' rows are in the key, exchanged per call)

    @st.compile_step(model=model, optimizer=optimizer, backend=None)
    def other(part, rows):
        return step.fn(part, rows)

    other(parts[me], 5)
    other(parts[me], 5)
    with pytest.raises(st.RanksDisagree) as err:  # each rank calls another step: both raise, neither waits
        (step if me == 0 else other)(parts[me], 5)
    return traces, str(err.value)


def test_rows_that_change_on_one_rank_trace_on_every_rank():
    # first call eager (0); each new pair of rows traces on both ranks, (3, 5) and (5, 3) included, although each
    # rank alone has seen its rows before; pairs seen before run their programs, a call from a compiled function too
    for traces, message in run_on_world(2, _rows_changing_on_one_rank):
        assert traces == [0, 1, 2, 3, 4, 5, 5, 6, 6, 6, 6]
        assert "called different steps at once (rank 0: step #" in message
        assert "<locals>.step), rank 1: step #" in message and message.endswith("<locals>.other))")


def _refusals():
    placement = st.placement("cpu", [0, 1])
    model = MLP(4, 4).to_global(placement, {"up.weight": S(0)})
    optimizer = _adamw(model)
    outside = torch.ones(4).to_global(placement, (B,))
    caught = []

    def reads_value(x):
        loss = model(x)
        loss.backward()
        optimizer.step()
        return loss.item()

    def reads_outside(x):
        loss = model(x * outside)
        loss.backward()
        optimizer.step()
        return loss

    class Counting(torch.optim.SGD):  # keeps a Python number in its state, which a program cannot change
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    self.state[p]["calls"] = self.state[p].get("calls", 0) + 1
            return super().step(closure)

    counting = Counting(model.parameters(), lr=0.1)

    def counts(x):
        loss = model(x)
        loss.backward()
        counting.step()
        return loss

    def takes_grad(x):
        loss = model(x)
        loss.backward()
        return loss

    cases = [(reads_value, optimizer), (reads_outside, optimizer), (counts, counting), (takes_grad, optimizer)]
    for fn, opt in cases:
        step = st.compile_step(fn, model=model, optimizer=opt, backend=None)
        x = torch.randn(3, 4).to_global(placement, (B,)).requires_grad_(fn is takes_grad)
        step(x)  # the first call runs eagerly
        with pytest.raises(st.StepNotTraceable) as err:
            step(x)
        caught.append(str(err.value).split(":", 1)[1].strip()[:48])
    for plan in ({"up.weight": S(0)}, {}):  # a program with collectives, then one without, on the CPU
        net = MLP(4, 4).to_global(placement, plan)
        net_optimizer = _adamw(net)

        def graphed(x):
            loss = net(x)
            loss.backward()
            net_optimizer.step()
            return loss

        step = st.compile_step(graphed, model=net, optimizer=net_optimizer, backend=None, cuda_graphs=True)
        x = torch.randn(3, 4).to_global(placement, (B,))
        step(x)
        with pytest.raises(st.StepNotTraceable) as err:
            step(x)
        caught.append(str(err.value).split(";", 1)[1].strip()[:48])

    # arguments: an expand()ed one cannot be copied into the graph's own; a slice with gaps can (then: the device)
    def lays_out(x):
        return graphed(x.to_global(placement, (B,), check_meta=False, sync_data=False))

    for rows in (torch.randn(1, 4).expand(3, 4), torch.randn(3, 5)[:, 1:]):
        step = st.compile_step(lays_out, model=net, optimizer=net_optimizer, backend=None, cuda_graphs=True)
        step(rows)
        with pytest.raises(st.StepNotTraceable) as err:
            step(rows)
        caught.append(str(err.value).split(";", 1)[1].strip()[:48])
    plain = MLP(2, 2)
    with pytest.raises(TypeError, match="plain tensors"):
        st.compile_step(lambda: None, model=plain)
    return caught


def test_refuses_what_it_cannot_trace_on_every_rank():
    caught = run_on_world(2, _refusals)
    assert caught[0] == caught[1]
    assert caught[0][0].startswith("the step reads a value")
    assert caught[0][1].startswith("the step reads a tensor that is neither")
    assert caught[0][2].startswith("the step changes the optimizer state's 'calls'")
    assert caught[0][3].startswith("an argument of the step requires grad")
    assert caught[0][4].startswith("this program holds some, and recording")
    assert caught[0][5].startswith("here they are on ['cpu']")
    assert caught[0][6].startswith("an argument whose elements share memory"), caught[0][6]
    assert caught[0][7].startswith("here they are on ['cpu']"), caught[0][7]


def _clipped_training(kind):
    """Gradient clipping inside the step (``clip_grad_norm_``'s all-reduced norm), tensor parallel or sharded."""
    torch.manual_seed(0)
    reference = MLP(6, 10)
    model = copy.deepcopy(reference)
    placement = st.placement("cpu", [0, 1])
    if kind == "sharded":
        model.to_global(placement, B, shard=0)
    else:
        model.to_global(placement, {"up.weight": S(0), "down.weight": S(1)})
    batches = _batches(5, 6, 6)
    ref_opt, optimizer = _adamw(reference), _adamw(model)
    want = []
    for x in batches:
        loss = reference(x)
        ref_opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        ref_opt.step()
        want.append(loss.item())

    @st.compile_step(model=model, optimizer=optimizer, backend=None)
    def step(x):
        loss = model(x.to_global(placement, (B,), check_meta=False).to_global(sbp=(S(0),)))
        optimizer.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        optimizer.step()
        return loss, norm

    with _programs_seen() as programs:
        got = [step(x)[0].item() for x in batches]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    _assert_params_match(model, reference)
    ops = torch.ops._c10d_functional
    merged = programs[0][ops.all_gather_into_tensor.default], programs[0][ops.reduce_scatter_tensor.default]
    return step.traces, merged, len(list(model.parameters()))


@pytest.mark.parametrize("kind", ["tensor parallel", "sharded"])
def test_clipping_inside_the_step(kind):
    for traces, (gathers, scatters), parameters in run_on_world(2, _clipped_training, kind):
        assert traces == 1
        if kind == "sharded":  # one unit: its parameters gathered, and their gradients reduced, in one bucket each
            assert (gathers, scatters) == (1, 1) and parameters > 1


class ScaledByANoGradProbe(nn.Module):
    """Its first module runs without autograd (a probe that scales the result), the second with it: a sharded
    unit's parameters converted at the probe's call must not stand in for the second's."""

    def __init__(self):
        super().__init__()
        self.probe = nn.Linear(6, 1)
        self.body = nn.Linear(6, 6)

    def forward(self, x):
        with torch.no_grad():
            scale = torch.sigmoid(self.probe(x)).mean()
        return (self.body(x) * scale).pow(2).mean()


def _sharded_unit_entered_without_grad():
    torch.manual_seed(0)
    reference = ScaledByANoGradProbe()
    model = copy.deepcopy(reference)
    placement = st.placement("cpu", [0, 1])
    model.to_global(placement, B, shard=0)
    ref_opt, optimizer = _adamw(reference), _adamw(model)
    batches = _batches(4, 6, 6)
    want = _plain_steps(reference, ref_opt, batches)
    step = _global_step(model, optimizer, placement, S(0), None)
    got = [step(x).item() for x in batches]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    _assert_params_match(model, reference)
    return step.traces


def test_a_sharded_unit_whose_first_module_runs_without_grad_trains_like_one_process():
    assert run_on_world(2, _sharded_unit_entered_without_grad) == [1, 1]


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(5, 8)
        self.a = nn.Linear(8, 3)
        self.b = nn.Linear(8, 3)

    def forward(self, x, head: str):
        return (getattr(self, head)(torch.relu(self.up(x))) + 1.0).pow(2).mean()


def _changing_state():
    """The state changes shape between calls: a head whose optimizer state first appears in a traced call, a
    frozen parameter, and gradients accumulated over two calls and emptied (``zero_grad()``) outside the step."""
    torch.manual_seed(0)
    reference = TwoHeads()
    model = copy.deepcopy(reference)
    placement = st.placement("cpu", [0, 1])
    model.to_global(placement, {"up.weight": S(0), "a.weight": S(1), "b.weight": S(1)})
    ref_opt, optimizer = _adamw(reference), _adamw(model)

    @st.compile_step(model=model, optimizer=optimizer, backend=None)
    def step(x, head, apply):
        loss = model(x.to_global(placement, (B,), check_meta=False).to_global(sbp=(S(0),)), head)
        loss.backward()
        if apply:
            optimizer.step()
        return loss

    calls = [("a", True), ("b", True), ("b", True), ("a", False), ("a", True), ("b", False), ("b", True)]
    calls += [("a", False), ("a", True), ("b", False), ("b", True)]
    for i, (head, apply) in enumerate(calls):
        if i == 4:  # freeze a parameter: its program differs
            for m in (model, reference):
                m.up.bias.requires_grad_(False)
        (x,) = _batches(1, 6, 5, seed=i)
        want = reference(x, head)
        want.backward()
        if apply:
            ref_opt.step()
            ref_opt.zero_grad()
        got = step(x, head, apply)
        if apply:
            optimizer.zero_grad()
        torch.testing.assert_close(got.item(), want.item(), rtol=1e-5, atol=1e-6)
        _assert_params_match(model, reference)
    return step.traces


def test_state_that_changes_between_calls():
    traces = run_on_world(2, _changing_state)
    assert traces[0] == traces[1] and traces[0] <= 8  # one program per (head, apply, frozen) seen, no more


def _failed_backward():
    """A trace that fails midway through backward (a hook reads a value) leaves no gradient bucket behind: the
    next eager step reduces its gradients as if no trace had run."""
    torch.manual_seed(0)
    reference = MLP(4, 6)
    model = copy.deepcopy(reference)
    placement = st.placement("cpu", [0, 1])
    model.to_global(placement, B)
    ref_opt, optimizer = _adamw(reference), _adamw(model)

    def reads_in_backward(module, args, out):
        if torch.compiler.is_compiling():  # only while compile_step traces
            out.register_hook(lambda grad: grad * grad.sum().item())

    model.up.register_forward_hook(reads_in_backward)

    def train(x):
        loss = model(x.to_global(placement, (B,), check_meta=False).to_global(sbp=(S(0),)))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss

    step = st.compile_step(train, model=model, optimizer=optimizer, backend=None)
    for i in range(3):
        (x,) = _batches(1, 6, 4, seed=i)
        want = reference(x)
        ref_opt.zero_grad()
        want.backward()
        ref_opt.step()
        if i == 1:
            with pytest.raises(st.StepNotTraceable):
                step(x)
        got = step(x) if i == 0 else train(x)  # the first call eager; then eager after the failed trace
        torch.testing.assert_close(got.item(), want.item(), rtol=1e-5, atol=1e-6)
        _assert_params_match(model, reference)
    return True


def test_a_failed_trace_leaves_no_pending_reduction():
    assert run_on_world(2, _failed_backward) == [True, True]


class Counting(MLP):
    """An MLP that registers a buffer on its first call and counts its calls in it."""

    def forward(self, x):
        if "calls" not in self._buffers:
            self.register_buffer("calls", torch.zeros(()))
        self.calls.add_(1)
        return super().forward(x)


def _late_buffer_and_inner_scheduler():
    placement = st.placement("cpu", [0, 1])
    model = Counting(4, 4).to_global(placement, {"up.weight": S(0)})
    optimizer = _adamw(model)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)

    def train(x, schedule: bool):
        loss = model(x.to_global(placement, (B,), check_meta=False).to_global(sbp=(S(0),)))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if schedule:
            scheduler.step()
        return loss

    step = st.compile_step(train, model=model, optimizer=optimizer, backend=None)
    (x,) = _batches(1, 3, 4)
    for _ in range(4):
        step(x, False)
    counted = model.calls.full_tensor().item()  # the trace counts nothing: 4 calls, 4 counts
    with pytest.raises(st.StepNotTraceable, match="sets the learning rate"):
        step(x, True)
    return counted, optimizer.param_groups[0]["lr"]


def test_a_late_buffer_is_state_and_a_scheduler_inside_is_refused():
    assert run_on_world(2, _late_buffer_and_inner_scheduler) == [(4.0, 1e-2)] * 2


def _refused_on_one_rank():
    placement = st.placement("cpu", [0, 1])
    model = MLP(4, 4).to_global(placement, B)
    optimizer = _adamw(model)

    @st.compile_step(model=model, optimizer=optimizer, backend=None)
    def step(x):
        loss = model(x.to_global(placement, (B,), check_meta=False))
        loss.backward()
        optimizer.step()
        return loss

    step(torch.ones(3, 4))
    with pytest.raises(st.StepNotTraceable) as err:  # rank 0's argument requires grad, rank 1's does not
        step(torch.ones(3, 4).requires_grad_(dist.get_rank() == 0))
    return str(err.value)


def test_a_refusal_on_one_rank_reaches_every_rank():
    messages = run_on_world(2, _refused_on_one_rank)
    assert messages[0].startswith("compile_step: an argument of the step requires grad")
    assert messages[1].startswith("rank(s) [0] could not trace compile_step's program; rank 0: compile_step: an")


def _changed_on_rank_1(change: str):
    """A data-parallel step that trains, or only evaluates in eval mode, run as a program; then rank 1 alone
    changes: it puts the model in eval mode, to be traced for (``eval``) or after both ranks traced for it
    (``switch``), or its program raises (``raises``); or the ranks made two steps in different orders (``order``)."""
    placement = st.placement("cpu", [0, 1])
    model = MLP(4, 4).to_global(placement, B)
    optimizer = _adamw(model)
    calls = []

    def backend(gm, examples):
        def run(*inputs):
            calls.append(None)
            if change == "raises" and len(calls) == 3 and dist.get_rank() == 1:
                raise ValueError("boom in rank 1's program")
            return gm(*inputs)

        return run

    def train(x):
        loss = model(x.to_global(placement, (B,), check_meta=False).to_global(sbp=(S(0),)))
        if model.training:
            loss.backward()
            optimizer.step()
        return loss

    def other(x):
        return train(x)

    made = [train, other] if change != "order" or dist.get_rank() == 0 else [other, train]
    step = {fn: st.compile_step(fn, model=model, optimizer=optimizer, backend=backend) for fn in made}[train]
    modes = [True, True, True] + ([False, True] if change == "switch" else [])  # (both ranks trace for eval)
    for training in modes:
        model.train(training)
        step(torch.ones(6, 4))
    if change in ("eval", "switch") and dist.get_rank() == 1:
        model.eval()
    step(torch.ones(6, 4))


@pytest.mark.parametrize("change", ["eval", "switch", "raises", "order"])
def test_a_change_or_failure_on_one_rank_is_an_error_on_every_rank(change):
    # without the ranks' posts at each call, rank 1 would trace alone, or fail alone, while rank 0 waits in its
    # program's collectives, both until the timeout (60 s here; a missing answer within 30 s fails the test); or
    # their programs' collectives would pair with others' (a wrong loss, then a wait)
    from world import RankFailure

    with pytest.raises(RankFailure) as caught:
        run_on_world(2, _changed_on_rank_1, change, _timeout=30)
    failures = caught.value.failures
    assert caught.value.missing == [] and sorted(failures) == [0, 1], caught.value
    if change == "order":  # (each rank finds it, at its first trace)
        for rank in (0, 1):
            assert "RanksDisagree: compile_step, step #" in failures[rank]
            assert "the ranks made their compiled steps in different orders (rank 0: step #" in failures[rank]
        return
    if change == "eval":
        why = "RanksDisagree: compile_step, step #"
        assert why in failures[1] and "traces a new program at call #4 while rank(s) [0] run" in failures[1]
        assert "On this rank a module's training flag changed." in failures[1]
    elif change == "switch":
        why = "RanksDisagree: compile_step, step #"
        assert why in failures[1] and "at call #6 rank(s) [0] ran another program than this rank's" in failures[1]
        assert "its key differs from this one's in a module's training flag." in failures[1]
    else:
        why = "ValueError in compile_step's program (step #"
        assert "ValueError: boom in rank 1's program" in failures[1]
    assert "CollectiveError: compile_step, step #" in failures[0] and "a collective of its program" in failures[0]
    assert f"posted by the ranks that failed:\n  rank 1 raised {why}" in failures[0], failures[0]


# Steps whose numbers depend on values of the data. Each either computes them inside the program (its sizes symbols
# of the trace, known when it runs) and matches one process at every call, or is refused on every rank, naming the
# line marked "# reads" that read a value. No trace may keep what the traced batch gave.
def _reads_a_number(h):
    if h.sum().item() > 0:  # reads
        return h * 2
    return h


def _tests_a_tensor(h):
    if (h > 0).any():  # reads
        return h * 2
    return h


def _slices_by_a_count(h):
    return h[: (h[:, 0] > 0).sum().tolist()]  # reads


def _global_nonzero(h):
    return h[(h[:, 0] > 0).nonzero()[:, 0]]  # reads


def _global_mask(h):
    return h[h > 0]  # reads


def _global_bincount(h):
    return h * torch.bincount(h.argmax(-1), minlength=4)[:4].float()  # reads


def _regional(body, out_shapes=None):
    """``body`` as a region on rows split over the ranks (on a plain tensor, itself: it works row by row)."""

    def run(h):
        if not isinstance(h, st.GlobalTensor):
            return body(h)
        return st.local_map(body, in_sbps=(S(0),), out_sbps=S(0), out_shapes=out_shapes)(h)  # reads

    return run


def _rows_kept_by_a_mask(x):
    keep = (x[:, 0] > 0).nonzero()[:, 0]
    return torch.zeros_like(x).index_add(0, keep, x[keep] * 3)


def _tokens_to_bins(x):
    """A routing in miniature: each row goes to the bin of its largest entry, counted, sorted and sent back."""
    bins = x.argmax(-1)
    counts = torch.zeros(4, dtype=torch.long).index_add(0, bins, torch.ones_like(bins))
    order = bins.argsort(stable=True)
    sizes = counts.tolist()  # as the experts' exchanges read their counts: symbols of the program when traced
    rows = order[: sum(sizes)]
    grouped = [part * (i + 1) for i, part in enumerate(x[rows].split(sizes))]
    return torch.zeros_like(x).index_add(0, rows, torch.cat(grouped))


def _top_two(h):
    kept = h.topk(2, -1).indices
    return torch.zeros_like(h).scatter(-1, kept, h.gather(-1, kept))


COMPUTED = {
    "top-k routing": _top_two,
    "sorting": lambda h: h.sort(-1).values.cumsum(-1),
    "scatter by index": lambda h: torch.zeros(4, 4).index_add(0, h.argmax(-1), h),
    "a mask": lambda h: torch.where(h > 0, h, h * 0.1),
    "a region's mask": _regional(_rows_kept_by_a_mask, lambda h: [h.shape]),
    "a region's counts": _regional(_tokens_to_bins, lambda h: [h.shape]),
}
_NUMBER = "reads a tensor's value as a number"
_SHAPE = "would have the shape (u"
# name -> (route, what the refusal says, the function whose line marked "# reads" it names)
REFUSED = {
    "item()": (_reads_a_number, _NUMBER, _reads_a_number),
    "a boolean test": (_tests_a_tensor, _NUMBER, _tests_a_tensor),
    "tolist()": (_slices_by_a_count, _NUMBER, _slices_by_a_count),
    "nonzero": (_global_nonzero, _SHAPE, _global_nonzero),
    "a boolean mask": (_global_mask, _SHAPE, _global_mask),
    "bincount": (_global_bincount, _SHAPE, _global_bincount),
    "a region's rows": (_regional(lambda x: x[x[:, 0] > 0]), "output 0's part on this rank would have", _regional),
}


class Routed(nn.Module):
    def __init__(self, route):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.route = route

    def forward(self, x):
        return (self.route(self.lin(x)) + 0.5).pow(2).mean()


def _routed_training(route, calls: int, backend=None):
    """``calls`` SGD steps of ``Routed(route)`` through ``compile_step`` (``backend``) on 2 ranks, each batch another
    routing: the relative error of each loss from one process's, or the refusal's message."""
    torch.manual_seed(0)
    reference = Routed(route)
    model = copy.deepcopy(reference).to_global(st.placement("cpu", [0, 1]), B)
    ref_opt, optimizer = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, model))
    step = _global_step(model, optimizer, model.lin.weight.placement, S(0), backend)
    errors = []
    for x in _batches(calls, 7, 4, seed=3):
        want = reference(x)
        ref_opt.zero_grad()
        want.backward()
        ref_opt.step()
        try:
            got = step(x).full_tensor().item()
        except st.StepNotTraceable as err:
            return str(err)
        errors.append(abs(got - want.item()) / abs(want.item()))
    return errors


def _all_computed(h):
    for route in COMPUTED.values():
        h = route(h)
    return h


def _every_read():
    # one program each (a wrong route gives a wrong loss); Inductor compiles the routing's data-dependent sizes
    computed = [_routed_training(_all_computed, 4, backend) for backend in (None, "inductor")]
    refused = {name: _routed_training(route, 2) for name, (route, _, _) in REFUSED.items()}
    # a forward that raised while traced skips the hook that leaves its module's global mode: none may stay behind
    assert torch._C._len_torch_function_stack() == 0, torch.overrides._get_current_function_mode_stack()
    return computed, refused


def _reading_line(function) -> str:
    """``file:line`` of the line marked ``# reads`` in ``function``'s source."""
    lines, first = inspect.getsourcelines(function)
    marked = next(i for i, line in enumerate(lines) if line.rstrip().endswith("# reads"))
    return f"test_compile_step.py:{first + marked}"


def test_values_of_the_data_are_computed_in_the_program_or_refused():
    (computed, refused), other = run_on_world(2, _every_read, _timeout=300)
    assert (computed, refused) == other  # every rank alike
    for errors in computed:
        assert isinstance(errors, list) and max(errors) < 1e-5, computed
    for name, message in refused.items():
        _, why, reader = REFUSED[name]
        assert isinstance(message, str) and why in message, (name, message)
        assert _reading_line(reader) in message, (name, message)
