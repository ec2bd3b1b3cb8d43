"""Collectives of a traced program merged into buckets (``sbp_torch._comm.bucket_collectives``): each program is
traced twice on 2 gloo ranks, once left as traced and once bucketed, and both run on the same inputs, whose values
differ per rank; they must give the same outputs and write the same accumulations, and merge exactly the
collectives the structural rule allows."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.fx.experimental.proxy_tensor import make_fx

from sbp_torch import _comm as comm

from world import run_on_world


def _group():
    return dist.group.WORLD


def _accumulated(g1, g2, g3, x):
    """Three reductions accumulated into inputs (gradients into their holders): one bucket."""
    g1.add_(funcol.all_reduce(x * 2, "sum", _group()))
    g2.add_(funcol.all_reduce(x * 3, "sum", _group()))
    g3.add_(funcol.all_reduce(x + 1, "sum", _group()))
    return x.sum()


def _read_between(g1, g2, g3, x):
    """The second result is read before the third is issued, from it: the third starts a bucket of its own."""
    g1.add_(funcol.all_reduce(x * 2, "sum", _group()))
    y = funcol.all_reduce(x + 1, "sum", _group()) * 5
    g3.add_(funcol.all_reduce(y, "sum", _group()))
    return y


def _written_after_issue(g1, g2, g3, x):
    """The first reduction's input is written into before the second is issued: merged, it would reduce the
    written value."""
    a = x * 2
    g1.add_(funcol.all_reduce(a, "sum", _group()))
    a.mul_(10)
    g2.add_(funcol.all_reduce(x * 3, "sum", _group()))
    return a


def _holder_read_between(g1, g2, g3, x):
    """An accumulated holder is read before the next reduction: its accumulation may not move after it."""
    g1.add_(funcol.all_reduce(x * 2, "sum", _group()))
    g2.add_(funcol.all_reduce(x * 3 + g1.sum(), "sum", _group()))
    return x.sum()


def _pure_readers(g1, g2, g3, x):
    """The first result is read by ops that only make outputs, then accumulated: they move after the bucket."""
    g1.add_(funcol.all_reduce(x * 2, "sum", _group()).clone() * 3)
    g2.add_(funcol.all_reduce(x * 3, "sum", _group()))
    return x.sum()


def _communicating_reader(g1, g2, g3, x):
    """The first result is read by another collective: it may not move, so the next all-reduce may not either."""
    g1.add_(funcol.all_gather_tensor(funcol.all_reduce(x * 2, "sum", _group()), 0, _group())[:4])
    g2.add_(funcol.all_reduce(x * 3, "sum", _group()))
    return x.sum()


def _list_written_then_read(g1, g2, g3, x):
    """A reader writes a list of tensors in place (a foreach op), one of which is read before the next reduction:
    the reader may not move past that read."""
    torch._foreach_mul_([g1, g2], funcol.all_reduce(x * 2, "sum", _group()).sum())
    y = g2 * 5
    g3.add_(funcol.all_reduce(x * 3, "sum", _group()))
    return y


def _last_member_reads_a_write(g1, g2, g3, x):
    """A reader writes the storage the last reduction reads (through a view made before): merged, the reduction
    would read it unwritten."""
    g1.add_(1.0)
    v = g1.view(12)
    g1.copy_(funcol.all_reduce(x * 2, "sum", _group()))
    g2.view(12).add_(funcol.all_reduce(v, "sum", _group()))
    return x.sum()


def _two_buckets_read_together(g1, g2, g3, x):
    """One node reads a result of each of two buckets (two dtypes) that end in the other order they began: it runs
    after both."""
    a = funcol.all_reduce(x * 2, "sum", _group())
    b = funcol.all_reduce(x.double() * 3, "sum", _group())
    both = a + b.float()
    b2 = funcol.all_reduce(x.double() + 1, "sum", _group())
    a2 = funcol.all_reduce(x * 4, "sum", _group())
    g1.add_(both)
    g2.add_(b2.float())
    g3.add_(a2)
    return x.sum()


def _scattered(g1, g2, g3, x):
    """Reduce-scatters whose results lose padding (a slice) before they are accumulated: one bucket."""
    g1[:1].add_(funcol.reduce_scatter_single(x * 2, "sum", 0, _group())[:1])
    g2.add_(funcol.reduce_scatter_single(x.reshape(6, 2), "sum", 0, _group())[:1])
    g3.add_(funcol.reduce_scatter_single(x + 1, "sum", 0, _group()))
    return x.sum()


PROGRAMS = {
    "accumulated": (_accumulated, 2),
    "read between": (_read_between, 1),
    "written after issue": (_written_after_issue, 0),
    "holder read between": (_holder_read_between, 0),
    "pure readers": (_pure_readers, 1),
    "communicating reader": (_communicating_reader, 0),
    "list written then read": (_list_written_then_read, 0),
    "last member reads a write": (_last_member_reads_a_write, 0),
    "two buckets read together": (_two_buckets_read_together, 2),
    "scattered": (_scattered, 2),
}


def _inputs(scattered: bool):
    rank = dist.get_rank()
    x = torch.arange(12.0).reshape(4, 3) * (rank + 1) + rank
    if scattered:
        return [torch.zeros(2, 3), torch.zeros(1, 2), torch.zeros(2, 3), x]
    return [torch.zeros(4, 3) for _ in range(3)] + [x]


def _compare(name):
    fn, merged = PROGRAMS[name]
    scattered = name == "scattered"
    traced = make_fx(fn, tracing_mode="fake")(*_inputs(scattered))
    bucketed = make_fx(fn, tracing_mode="fake")(*_inputs(scattered))
    removed = comm.bucket_collectives(bucketed)
    left = [n for n in bucketed.graph.nodes if n.op == "call_function" and "wait_tensor" in str(n.target)]
    want_inputs, got_inputs = _inputs(scattered), _inputs(scattered)
    want, got = traced(*want_inputs), bucketed(*got_inputs)
    torch.testing.assert_close(got, want)
    for a, b in zip(got_inputs, want_inputs):
        torch.testing.assert_close(a, b)
    return removed, merged, len(left)


@pytest.mark.gloo
@pytest.mark.parametrize("name", list(PROGRAMS))
def test_a_bucketed_program_gives_the_traced_programs_values_and_merges_only_what_the_rule_allows(name):
    for removed, merged, _ in run_on_world(2, _compare, name):
        assert removed == merged
