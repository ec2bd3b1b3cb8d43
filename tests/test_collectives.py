"""Collective failures say what was being waited for instead of hanging or failing silently."""

import datetime

import pytest
import torch
import torch.distributed as dist

from sbp_torch import CollectiveError
from sbp_torch import _comm as coll
from sbp_torch._comm import AxisGroup

from world import run_on_world

pytestmark = pytest.mark.gloo


def all_reduce_with_a_missing_peer():
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=2))  # every rank enters new_group
    if dist.get_rank() == 1:
        return None  # rank 1 never joins the all-reduce
    try:
        coll.all_reduce(torch.ones(3, 2), "sum", AxisGroup((0, 1), 0, group))
    except CollectiveError as err:
        return str(err)
    return "no error"


def test_timeout_names_the_collective_the_ranks_and_the_tensor():
    message = run_on_world(2, all_reduce_with_a_missing_peer)[0]
    assert "all-reduce(sum) on ranks [0, 1]" in message
    assert "(3, 2) torch.float32" in message and "waiting for the other ranks" in message


def gather_in_placement_order(ranks, sizes):
    """All-gather of uneven parts along an axis whose rank order is not sorted."""
    me = ranks.index(dist.get_rank())
    group = AxisGroup(tuple(ranks), me, dist.group.WORLD)
    part = torch.full((sizes[me], 2), float(me))
    return coll.all_gather(part, 0, sizes, group)


def test_uneven_gather_follows_placement_order_not_rank_order():
    ranks, sizes = [2, 0, 1], [3, 0, 1]
    want = torch.cat([torch.full((n, 2), float(i)) for i, n in enumerate(sizes)])
    for got in run_on_world(3, gather_in_placement_order, ranks, sizes):
        assert torch.equal(got, want)


def axis_group_timeout():
    from sbp_torch._comm._groups import _process_group

    group = _process_group((0, 1))  # a strict subset of the 3-rank world: a new group
    if dist.get_rank() == 2:
        return None
    return group._get_backend(torch.device("cpu")).options._timeout


def test_axis_groups_inherit_the_world_timeout():
    """A stuck axis collective fails after the user's timeout, not gloo's 30-minute default."""
    from world import PG_TIMEOUT

    assert run_on_world(3, axis_group_timeout)[:2] == [PG_TIMEOUT, PG_TIMEOUT]
