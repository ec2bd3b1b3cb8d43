"""Global programs under ``torch.compile`` give the single-process result, forward and backward.

Each test compiles a program on global tensors (``fullgraph=True``) and compares it with the same program on
plain tensors in one process, at every call; a call after the trace gets new values, so that a program that kept
what its traced values gave is wrong there. Most use the ``aot_eager`` backend (it runs the traced graph as
traced, so a wrong trace shows as a wrong number); a few use ``inductor``, which must also lower the collectives."""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
from hypothesis import given, settings
from hypothesis import strategies as st_

import sbp_torch as st
from sbp_torch._api import _global_mode
from sbp_torch.sbp import broadcast as B
from sbp_torch.sbp import partial_max as PMAX
from sbp_torch.sbp import partial_sum as P
from sbp_torch.sbp import split as S

from op_check import check_op, layout
from world import run_on_world

pytestmark = pytest.mark.gloo


def _mlp_inputs(rows, inner, hidden, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for shape in ((rows, inner), (inner, hidden), (hidden, inner))]


ISSUE_SIZES = (32, 64, 128)  # the reproduction in the issue: every split even on 2 ranks
UNEVEN_SIZES = (33, 17, 31)  # no split of these is even on 2, 3 or 4 ranks
X, W1, W2 = _mlp_inputs(*ISSUE_SIZES)
OTHER_X = _mlp_inputs(*ISSUE_SIZES, seed=1)[0]  # for a call after the trace: a program must not keep X's values


def mlp_loss(x, w1, w2):
    return (torch.relu(x @ w1) @ w2 + 1.0).pow(2).mean()


class Graphs:
    """A torch.compile backend that counts the graphs it is given and runs them through AOTAutograd."""

    def __init__(self, backend: str):
        self.count, self.backend = 0, backend

    def __call__(self, gm, example_inputs):
        self.count += 1
        return torch._dynamo.lookup_backend(self.backend)(gm, example_inputs)


def compiled(fn, backend="aot_eager"):
    torch._dynamo.reset()
    return torch.compile(fn, backend=backend, fullgraph=True)


def _mlp_loss_and_grads(ranks, backend, x_sbps, w1_sbp, w2_sbp, sizes=ISSUE_SIZES):
    """The issue's reproduction: loss and gradients of ``mlp_loss`` compiled, for ``x`` in each of ``x_sbps``
    in turn (new values each time), against one process; returns the number of graphs compiled."""
    p = st.placement("cpu", ranks)
    _, W1, W2 = _mlp_inputs(*sizes)
    graphs = Graphs(backend)
    torch._dynamo.reset()
    f = torch.compile(mlp_loss, backend=graphs, fullgraph=True)
    w1 = layout(W1, p, w1_sbp).detach().requires_grad_()
    w2 = layout(W2, p, w2_sbp).detach().requires_grad_()
    new_values = torch.Generator().manual_seed(1)
    for x_sbp in x_sbps:
        # new values at every call, so that a graph reused is never given the values it was traced with
        X = torch.randn(sizes[:2], generator=new_values)
        ref_w1, ref_w2 = W1.clone().requires_grad_(), W2.clone().requires_grad_()
        mlp_loss(X, ref_w1, ref_w2).backward()
        w1.grad = w2.grad = None
        loss = f(layout(X, p, x_sbp), w1, w2)
        loss.backward()
        torch.testing.assert_close(loss.full_tensor(), mlp_loss(X, W1, W2), rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(w1.grad.full_tensor(), ref_w1.grad, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(w2.grad.full_tensor(), ref_w2.grad, rtol=1e-4, atol=1e-4)
    return graphs.count


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_reproduction_gives_the_eager_loss_and_gradients(backend):
    # x broadcast twice in a row reuses the graph; x split is another layout, so another graph.
    counts = run_on_world(2, _mlp_loss_and_grads, [0, 1], backend, [B, B, S(0)], S(1), S(0))
    assert counts == [2, 2]


def test_a_layout_change_recompiles_and_a_repeated_one_does_not():
    x_sbps = [B, S(0), B, S(1), S(0)]
    counts = run_on_world(3, _mlp_loss_and_grads, [0, 1, 2], "aot_eager", x_sbps, S(1), S(0), UNEVEN_SIZES)
    assert counts == [3, 3, 3]


def test_mesh_with_uneven_parts():
    x_sbps = [(S(0), B), (S(1), S(0)), (S(0), B)]  # the last runs the first's program on new values
    run_on_world(4, _mlp_loss_and_grads, [[0, 1], [2, 3]], "aot_eager", x_sbps, (B, S(1)), (S(1), S(0)), UNEVEN_SIZES)


SBPS = [B, P, PMAX, S(0), S(1)]


def _compiled_program(ranks, rows, cols, sbps):
    p = st.placement("cpu", ranks)
    gen = torch.Generator().manual_seed(rows * 100 + cols)

    def program(a, b):
        h = torch.tanh(a * 2.0 + b).softmax(dim=-1)
        return h.sum(0), (h * b).mean(1)

    fast = compiled(program)
    run = lambda *args: fast(*args) if args[0].is_global else program(*args)  # noqa: E731
    for _ in range(2):  # the traced program, then the same program on new values
        a, b = torch.randn(rows, cols, generator=gen), torch.randn(rows, cols, generator=gen)
        check_op(run, [a, b], p, sbps)


@given(
    world=st_.sampled_from([[0, 1], [0, 1, 2]]),
    rows=st_.integers(1, 7),
    cols=st_.integers(1, 6),
    sbps=st_.lists(st_.sampled_from(SBPS), min_size=2, max_size=2),
)
@settings(max_examples=6)
def test_random_layouts_compiled_match_one_process(world, rows, cols, sbps):
    run_on_world(len(world), _compiled_program, world, rows, cols, sbps)


def _to_global_inside(ranks):
    """``to_global`` of this rank's uneven part inside a compiled function: the parts' sizes change, on some ranks
    only, their values at every call, and every call gives the one-process result (the part is laid out at each
    call, outside the compiled graphs); with ``fullgraph=True`` every rank raises, naming why."""
    p = st.placement("cpu", ranks)
    me = torch.distributed.get_rank()

    def program(local, w):
        x = local.to_global(p, S(0))  # uneven parts: the global tensor depends on every rank's
        return (x.to_global(sbp=S(1)) * w).sum(0)

    graphs = Graphs("aot_eager")
    torch._dynamo.reset()
    f = torch.compile(program, backend=graphs, dynamic=False)
    # (5, 3, 3) and (3, 2, 4) mix the sizes of the first two: each rank alone has seen its part's size before; new
    # values at every call, so that a graph reused is never given the values it was traced with
    new_values = torch.Generator().manual_seed(0)
    for sizes in ([5, 2, 4], [5, 2, 4], [3, 3, 3], [5, 3, 3], [3, 2, 4]):
        parts = [torch.randn(n, 6, generator=new_values) for n in sizes]
        full = torch.cat(parts)
        got = f(parts[me], layout(full, p, B))
        torch.testing.assert_close(got.full_tensor(), (full * full).sum(0), msg=str(sizes))
    with pytest.raises(torch._dynamo.exc.Unsupported, match="sbp_torch: to_global of this rank's part runs"):
        compiled(program)(parts[me], layout(full, p, B))
    return graphs.count


def test_to_global_inside_a_compiled_program():
    assert run_on_world(3, _to_global_inside, [0, 1, 2])[0] > 0


def _to_global_under_global_mode(ranks):
    p = st.placement("cpu", ranks)

    def program(x, w1, w2_part):
        # Dynamo hands the method to the torch function mode, which calls it as a function; and the function form,
        # of this rank's part, which runs outside the compiled graphs (a graph break: not fullgraph)
        with st.global_mode(p, B):
            return mlp_loss(x, w1.to_global(sbp=B), st.to_global(w2_part, p, S(0)))

    torch._dynamo.reset()
    f = torch.compile(program, backend="aot_eager")
    for seed in (0, 1):  # the traced program, then the same program on new values
        full_x, full_w1, full_w2 = _mlp_inputs(*ISSUE_SIZES, seed=seed)
        x, w1 = layout(full_x, p, S(0)), layout(full_w1, p, S(0)).detach().requires_grad_()
        w2_part = full_w2.tensor_split(len(ranks))[torch.distributed.get_rank()]
        ref_w1 = full_w1.clone().requires_grad_()
        loss = f(x, w1, w2_part)
        loss.backward()
        want = mlp_loss(full_x, ref_w1, full_w2)
        want.backward()
        torch.testing.assert_close(loss.full_tensor(), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(w1.grad.full_tensor(), ref_w1.grad, rtol=1e-4, atol=1e-5)


def test_to_global_under_global_mode_inside_a_compiled_program():
    run_on_world(3, _to_global_under_global_mode, [0, 1, 2])


def _across_placements():
    line, pair = st.placement("cpu", [0, 1, 2]), st.placement("cpu", [2, 0])
    layout(X, pair, B)  # the process groups of a placement are made outside the compiled program
    f = compiled(lambda x: (x.to_global(pair, S(1)) * 2).sum(1))
    for full in (X, OTHER_X):  # the traced program, then the same program on new values
        got = f(layout(full, line, S(0)))
        if torch.distributed.get_rank() in pair:
            torch.testing.assert_close(got.full_tensor(), (full * 2).sum(1))
    # with a gradient, rank 1 (outside the pair) would wait in the compiled backward: every rank refuses instead
    x = layout(X, line, S(0)).detach().requires_grad_()
    with pytest.raises(Exception, match="inside a compiled program, with a gradient"):
        compiled(lambda x: (x.to_global(pair, S(1)) * 2).sum())(x)


def test_boxing_across_placements_inside_a_compiled_program():
    run_on_world(3, _across_placements)


def _optimizer_step(ranks, backend):
    p = st.placement("cpu", ranks)
    torch.manual_seed(0)
    model, reference = torch.nn.Linear(16, 24), torch.nn.Linear(16, 24)
    reference.load_state_dict(model.state_dict())
    model.to_global(p, {"weight": S(0), "bias": S(0)})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, foreach=True)
    torch._dynamo.reset()
    step = torch.compile(optimizer.step, backend=backend)
    forward = torch.compile(model, backend=backend, fullgraph=True)
    new_values = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(32, 16, generator=new_values)  # new values at every step, traced or not
        optimizer.zero_grad()
        reference_optimizer.zero_grad()
        loss, want = forward(layout(x, p, S(0))).pow(2).mean(), reference(x).pow(2).mean()
        loss.backward()
        want.backward()
        step()
        reference_optimizer.step()
        torch.testing.assert_close(loss.full_tensor(), want)
        torch.testing.assert_close(model.weight.full_tensor(), reference.weight)
        torch.testing.assert_close(model.bias.full_tensor(), reference.bias)


def test_compiled_adamw_steps_match_one_process():
    run_on_world(3, _optimizer_step, [0, 1, 2], "aot_eager")


def _reduced_in_compiled_backward(ranks, backend):
    """Data parallelism: the gradient reduction of ``Module.to_global`` runs inside the compiled backward, so
    backward itself issues no collective eagerly (it does eagerly), and the gradients are one process's."""
    from sbp_torch import _comm

    p = st.placement("cpu", ranks)
    torch.manual_seed(0)
    # (LayerNorm: F.layer_norm passes its weight and bias to torch as keywords)
    reference = torch.nn.Sequential(
        torch.nn.Linear(17, 31), torch.nn.LayerNorm(31), torch.nn.ReLU(), torch.nn.Linear(31, 17)
    )
    model = copy.deepcopy(reference).to_global(p, B)
    fast = compiled(model, backend)
    issued = {}
    # the second compiled call runs the traced program on new values
    for name, forward, seed in (("eager", model, 2), ("compiled", fast, 2), ("compiled", fast, 3)):
        x = torch.randn(13, 17, generator=torch.Generator().manual_seed(seed))  # uneven rows on 3 ranks
        reference.zero_grad()
        want_loss = reference(x).pow(2).mean()
        want_loss.backward()
        model.zero_grad()
        loss = forward(layout(x, p, S(0))).pow(2).mean()
        with _comm.observing(lambda kind, group, nbytes, name=name: issued.setdefault(name, []).append(kind)):
            loss.backward()
        torch.testing.assert_close(loss.full_tensor(), want_loss)
        for param, want in zip(model.parameters(), reference.parameters()):
            assert param.grad.sbp == (B,)
            torch.testing.assert_close(param.grad.full_tensor(), want.grad)
    assert issued.get("eager") and not issued.get("compiled"), issued


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_data_parallel_gradients_are_reduced_inside_the_compiled_backward(backend):
    run_on_world(3, _reduced_in_compiled_backward, [0, 1, 2], backend)


def _mixed(ranks):
    p = st.placement("cpu", ranks)
    w1, w2 = layout(W1, p, S(1)), layout(W2, p, S(0))
    fast = compiled(mlp_loss)
    new_values = torch.Generator().manual_seed(1)
    for x_sbp in (S(0), B, S(0)):  # the last runs the first's program on new values
        x = layout(torch.randn(X.shape, generator=new_values), p, x_sbp)
        assert torch.equal(fast(x, w1, w2).full_tensor(), mlp_loss(x, w1, w2).full_tensor())


def test_compiled_and_eager_calls_on_the_same_tensors_agree():
    run_on_world(2, _mixed, [0, 1])


def _mixing_plain_and_global(ranks):
    p = st.placement("cpu", ranks)
    with pytest.raises(Exception, match=r"mul: cannot mix a global tensor with a plain tensor of shape \(32, 64\)"):
        compiled(lambda x, y: x * y)(layout(X, p, S(0)), X)


def test_an_op_that_cannot_run_names_itself_under_compile():
    run_on_world(2, _mixing_plain_and_global, [0, 1])


def _explain_matches_a_run(ranks):
    """``explain`` lists, without sending anything, the collectives an eager step then issues: same kinds, same
    counts, same order, forward and backward, gradient reduction included."""
    from sbp_torch import _comm

    p = st.placement("cpu", ranks)
    X, W1, W2 = _mlp_inputs(*UNEVEN_SIZES)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(17, 31), torch.nn.ReLU(), torch.nn.Linear(31, 17))
    model.to_global(p, {"0.*": S(0), "2.weight": S(1), "*": B})
    x = layout(X, p, S(0))

    def step(x):
        return model(x).pow(2).mean()

    explained = st.explain(step, x)
    assert all(param.grad is None for param in model.parameters())  # explain leaves no gradients behind
    issued = []
    with _comm.observing(lambda kind, group, nbytes: issued.append((kind, tuple(group.ranks)))):
        step(x).backward()
    assert [(c.kind, c.ranks) for c in explained] == issued
    assert any(c.backward for c in explained) and any(not c.backward for c in explained)
    assert any("aten.mm" in c.cause or "aten.addmm" in c.cause for c in explained), str(explained)
    reductions = [c for c in explained if c.cause.startswith("gradient reduction")]
    assert reductions and all(c.backward for c in reductions), str(explained)

    # Across placements the exchange is point to point when run and an all-to-all when traced: one entry each.
    pair = st.placement("cpu", [ranks[-1], ranks[0]])
    layout(X, pair, B)  # (the pair's process groups are made outside explain)

    def across(x):
        return (x.to_global(pair, S(1)) * 2).sum()

    moved = st.explain(across, x.detach().requires_grad_())
    issued = []
    with _comm.observing(lambda kind, group, nbytes: issued.append((kind, tuple(group.ranks), nbytes))):
        across(x.detach().requires_grad_()).backward()
    assert [(c.kind, c.ranks, c.bytes) for c in moved] == issued
    assert [c.kind for c in moved] == ["point-to-point exchange"] * 2
    return str(explained)


def test_explain_lists_what_a_step_issues():
    reports = run_on_world(3, _explain_matches_a_run, [0, 1, 2])
    assert "all-reduce" in reports[0] or "reduce-scatter" in reports[0]


def _unfold(ranks):
    # unfold's result is a view whose part overlaps itself; its traced gradient must not keep those strides
    p = st.placement("cpu", ranks)
    gen = torch.Generator().manual_seed(1)

    def program(x):
        return x.unfold(0, 3, 1)

    fast = compiled(program)
    run = lambda x: fast(x) if x.is_global else program(x)  # noqa: E731
    for _ in range(2):  # the traced program, then the same program on new values
        check_op(run, [torch.randn(5, 5, 5, 5, generator=gen)], p, [S(0)])


def test_the_gradient_of_an_overlapping_view_compiled():
    run_on_world(2, _unfold, [0, 1])


def _factories_and_an_unused_output(ranks):
    """Under global mode, torch's factories inside a compiled program build global tensors (each rank keeps its
    region of the value, split included); an output the loss never reaches gets a plain zero gradient from
    autograd, which the compiled backward takes as that output's global gradient."""
    p = st.placement("cpu", ranks)

    def program(x):
        positions = torch.arange(x.shape[1], dtype=x.dtype)
        rows = torch.ones(x.shape[0], 1)
        return (x * positions + rows).pow(2).sum(), x.cos()

    new_values = torch.Generator().manual_seed(3)

    def check(fast, mode_sbp, x_sbp):
        full = torch.randn(7, 5, generator=new_values)  # new at every call; 7 rows: uneven on 2 and 3 ranks
        want = full.clone().requires_grad_()
        program(want)[0].backward()
        x = layout(full, p, x_sbp).detach().requires_grad_()
        with st.global_mode(p, mode_sbp):
            loss, unused = fast(x)
        assert unused.requires_grad  # its gradient is never asked for
        loss.backward()
        torch.testing.assert_close(loss.full_tensor(), program(full)[0])
        torch.testing.assert_close(x.grad.full_tensor(), want.grad)
        return x

    for mode_sbp, x_sbp in ((B, S(0)), (S(0), B), (S(1), S(1))):
        fast = compiled(program)
        check(fast, mode_sbp, x_sbp)
    x = check(fast, mode_sbp, x_sbp)  # the last layout's program once more, on new values
    if _global_mode._FACTORIES_BYPASS_MODES_UNDER_DYNAMO:
        return  # torch 2.11's Dynamo does not send randn to the mode: its plain value is taken as a factory's
    with st.global_mode(p), pytest.raises(Exception, match="randn under global mode inside a compiled program"):
        compiled(lambda x: x * torch.randn(5))(x)


def test_factories_and_unused_outputs_inside_a_compiled_program():
    run_on_world(3, _factories_and_an_unused_output, [0, 1, 2])


def _convolution_split_by_output_channel(ranks):
    # The bias gradient of a channel-split convolution is this rank's channels: torch's traced shape function
    # takes it from an argument (bias_sizes), not from the gradient as the kernel does.
    p = st.placement("cpu", ranks)
    gen = torch.Generator().manual_seed(4)

    def program(x, w, b):
        return torch.nn.functional.conv2d(x, w, b, padding=1).tanh()

    fast = compiled(program)
    run = lambda *a: fast(*a) if a[0].is_global else program(*a)  # noqa: E731
    for _ in range(2):  # the traced program, then the same program on new values
        images_filters_bias = [torch.randn(shape, generator=gen) for shape in ((2, 3, 5, 5), (7, 3, 3, 3), (7,))]
        check_op(run, images_filters_bias, p, [B, S(0), S(0)])


def test_a_convolution_split_by_output_channel_compiled():
    run_on_world(2, _convolution_split_by_output_channel, [0, 1])


def _mesh_recompile_with_a_gradient(backend):
    """The issue's 2x2 recompile: ``x`` (with a gradient) in ``(S(0), B)`` twice, then ``(B, S(0))``. In the
    backward of the second program, the point-to-point exchange of x's gradient has nothing to send on two ranks;
    its buffer was made from nothing there, so AOTAutograd put that exchange in their forward graph, and gloo
    aborted on mismatched sizes."""
    p = st.placement("cpu", [[0, 1], [2, 3]])
    _, W1, W2 = _mlp_inputs(7, 17, 9)
    torch._dynamo.reset()
    f = torch.compile(mlp_loss, backend=backend, fullgraph=True)
    w1 = layout(W1, p, (B, S(1))).detach().requires_grad_()
    w2 = layout(W2, p, (S(1), S(0))).detach().requires_grad_()
    new_values = torch.Generator().manual_seed(1)
    for x_sbp in [(S(0), B), (S(0), B), (B, S(0))]:
        X = torch.randn(7, 17, generator=new_values)  # so that the second call does not meet the traced values
        refs = [t.clone().requires_grad_() for t in (X, W1, W2)]
        mlp_loss(*refs).backward()
        w1.grad = w2.grad = None
        x = layout(X, p, x_sbp).detach().requires_grad_()
        loss = f(x, w1, w2)
        loss.backward()
        torch.testing.assert_close(loss.full_tensor(), mlp_loss(X, W1, W2), rtol=1e-5, atol=1e-4)
        for got, ref in zip((x, w1, w2), refs):
            torch.testing.assert_close(got.grad.full_tensor(), ref.grad, rtol=1e-4, atol=1e-4)


def test_a_mesh_recompile_with_uneven_parts_under_inductor():
    run_on_world(4, _mesh_recompile_with_a_gradient, "inductor")


def _rank_dependent_program(ranks):
    p = st.placement("cpu", ranks)
    x = layout(X, p, S(0))

    def program(x, gather: bool):
        return (x.to_global(sbp=B) if gather else x).sum()

    me = torch.distributed.get_rank()
    with pytest.raises(Exception, match="compiled programs whose collectives differ") as raised:
        compiled(program)(x, me == 0)  # rank 0's program gathers, the others' do not
    message = str(raised.value)
    assert "collective #0 on the group of ranks [0, 1, 2]: rank 0 issues all-gather" in message, message
    assert "rank 1 issues nothing more" in message, message
    # the world is still in step: the same program on every rank runs, traced and on new values
    f = compiled(program)
    for full in (X, OTHER_X):
        torch.testing.assert_close(f(layout(full, p, S(0)), True).full_tensor(), full.sum())


def test_ranks_whose_compiled_programs_differ_raise_instead_of_aborting():
    run_on_world(3, _rank_dependent_program, [0, 1, 2])


def test_the_first_difference_between_compiled_programs_is_named():
    from sbp_torch._comm._compiled import Traced, first_difference

    pair, line = (0, 1), (0, 1, 2)
    reduce = Traced("all-reduce(sum)", pair, "torch.float32", (3, 4), None, None)
    assert first_difference({0: [reduce], 1: [reduce]}) is None
    other = reduce._replace(shape=(2, 4))
    assert "rank 1 issues all-reduce(sum) of a torch.float32 (2, 4)" in first_difference({0: [reduce], 1: [other]})
    # an all-to-all matches when what each rank sends another is what that one receives
    a2a = [Traced("all-to-all", line, "torch.float32", (6,), (1, 2, 3), (1, 1, 1)) for _ in line]
    a2a = [a._replace(sends=tuple(3 * [r + 1]), receives=(1, 2, 3)) for r, a in enumerate(a2a)]
    assert first_difference({r: [a] for r, a in enumerate(a2a)}) is None
    a2a[2] = a2a[2]._replace(receives=(1, 2, 4))
    assert "collective #0 on the group of ranks [0, 1, 2]" in first_difference({r: [a] for r, a in enumerate(a2a)})
    # groups are compared on their own: rank 2 is in no group with rank 0's extra collective
    solo = Traced("all-gather", (0, 2), "torch.float32", (1,), None, None)
    assert "rank 2 issues nothing more" in first_difference({0: [solo, reduce], 1: [reduce], 2: []})
    assert first_difference({0: [reduce], 1: [reduce], 2: []}) is None


@pytest.mark.parametrize(
    "size, world, seed, backends",
    [
        # ranks whose joint graphs differ in shapes, so that the partition may differ, on both backends
        (3, "line", 73, ("aot_eager", "inductor")),
        # ranks that only send, or hold empty parts, read nothing a collective returns: the partition dropped it
        (4, "mesh", 11, ("inductor",)),
    ],
)
def test_random_programs_that_left_ranks_out_of_step(size, world, seed, backends):
    import compile_fuzz

    # (without routing steps: the programs these seeds drew when they failed)
    per_rank = run_on_world(size, compile_fuzz.run_program, seed, world, backends, False, _timeout=400)
    for calls in zip(*per_rank):
        assert {c[2] for c in calls} == {"match"}, calls


def test_a_few_random_programs_compiled():
    import compile_fuzz

    # seed 6 puts a mask and a sort (routing steps) around its matrix product; three calls of each backend, four
    # of compile_step
    per_rank = run_on_world(3, compile_fuzz.run_batch, [6], "line", _timeout=400)
    outcomes = [o for o in per_rank[0][0]]
    assert len(outcomes) == 10, outcomes
    for calls in zip(*(rank[0] for rank in per_rank)):
        assert {c[2] for c in calls} == {"match"}, calls
