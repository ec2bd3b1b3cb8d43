"""Checkpoints of global state through torch.distributed.checkpoint: saved at one world size and layout, loaded
at another, the full tensors are bit-identical; bad checkpoints and mismatched states are refused on every rank
and change nothing."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from hypothesis import example, given, seed, settings
from hypothesis import strategies as st_
from safetensors.torch import load_file, save_file
from torch import nn

import sbp_torch as st
from sbp_torch.checkpoint import CheckpointError
from sbp_torch.sbp import broadcast, partial, split
from zoo import dense, training

from world import run_on_world

pytestmark = pytest.mark.gloo

MESHES = {2: [0, 1], 3: [0, 1, 2], 4: [0, 1, 2, 3], "2x2": [[0, 1], [2, 3]]}
PAIRS = [(4, 2), (2, 4), (2, 3), (3, 2), ("2x2", 4), (4, "2x2")]
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "int64": torch.int64}


def _world(mesh) -> int:
    return 4 if mesh == "2x2" else mesh


def _axes(mesh) -> int:
    return 2 if mesh == "2x2" else 1


@st_.composite
def _layouts(draw, ndim: int, axes: int, partial_ok: bool):
    """One SBP per placement axis for a tensor of ``ndim`` dims, as (kind, arg) pairs the workers rebuild."""
    choices = [("split", d) for d in range(ndim)] + [("broadcast", None)]
    if partial_ok:
        choices += [("partial", op) for op in ("sum", "max", "min")]
    return tuple(draw(st_.sampled_from(choices)) for _ in range(axes))


def _sbp(layout):
    return tuple({"split": split, "partial": partial}[k](a) if k != "broadcast" else broadcast for k, a in layout)


@st_.composite
def _states(draw, source, target):
    shape = st_.lists(st_.integers(1, 7), min_size=1, max_size=3).map(tuple)
    params = draw(st_.lists(shape, min_size=2, max_size=3))
    extra_shape = draw(shape)
    return {
        "seed": draw(st_.integers(0, 2**16)),
        "params": params,
        "extra_shape": extra_shape,
        "extra_dtype": draw(st_.sampled_from(sorted(DTYPES))),
        "layouts": {
            mesh: {
                "params": [draw(_layouts(len(s), _axes(mesh), False)) for s in params],
                "extra": draw(_layouts(len(extra_shape), _axes(mesh), True)),
            }
            for mesh in (source, target)
        },
    }


def _build(spec: dict, mesh, seed: int):
    """The model (a ParameterDict), its AdamW and an extra tensor of ``spec``, laid out as ``spec`` says for
    ``mesh``, with values drawn from ``seed``."""
    p = st.placement("cpu", MESHES[mesh])
    layout = spec["layouts"][mesh]
    gen = torch.Generator().manual_seed(seed)
    model = nn.ParameterDict(
        {f"w{i}": nn.Parameter(torch.randn(s, generator=gen)) for i, s in enumerate(spec["params"])}
    )
    model.to_global(p, {f"w{i}": _sbp(sbp) for i, sbp in enumerate(layout["params"])})
    extra = (torch.randn(spec["extra_shape"], generator=gen) * 100).to(DTYPES[spec["extra_dtype"]])
    extra = st.tensor(extra, placement=p, sbp=_sbp(layout["extra"]))
    return model, torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1), extra


def _full(model, optimizer, extra, step) -> dict:
    """Every value of the state as plain tensors (on rank 0; empty elsewhere)."""
    out = {"model": st.full_state_dict(model), "optim": st.full_state_dict(optimizer), "extra": extra.full_tensor()}
    return {**out, "step": step} if dist.get_rank() == 0 else {}


def _save(spec, mesh, path):
    model, optimizer, extra = _build(spec, mesh, spec["seed"])
    for _ in range(2):  # moments that differ from their initial values
        sum((w * w).sum() for w in model.values()).backward()
        optimizer.step()
        optimizer.zero_grad()
    st.checkpoint.save({"model": model, "optim": optimizer, "extra": extra, "step": 7}, path)
    return _full(model, optimizer, extra, 7)


def _load(spec, mesh, path):
    model, optimizer, extra = _build(spec, mesh, spec["seed"] + 1)  # other values, another layout
    state = {"model": model, "optim": optimizer, "extra": extra, "step": 0}
    st.checkpoint.load(state, path)
    return _full(model, optimizer, extra, state["step"])


def _assert_identical(got, want, where="state"):
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, where
        assert torch.equal(got, want), where
    elif isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for key in want:
            _assert_identical(got[key], want[key], f"{where}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            _assert_identical(a, b, f"{where}[{i}]")
    else:
        assert got == want, where


# A state saved with partial extras (each reduction) and split parameters of three shapes, loaded split otherwise
_S0, _S1, _S2, _B = ("split", 0), ("split", 1), ("split", 2), ("broadcast", None)
_SAVED_PARTIAL = {
    (3, 2): {
        3: {"params": [(_S0,), (_S0,), (_S2,)], "extra": (("partial", "sum"),)},
        2: {"params": [(_S1,), (_B,), (_S0,)], "extra": (_S1,)},
    },
    ("2x2", 4): {
        "2x2": {"params": [(_S0, _S1), (_S0, _S1), (_B, _S2)], "extra": (("partial", "max"), _S1)},
        4: {"params": [(_S1,)] * 3, "extra": (("partial", "min"),)},
    },
}


@pytest.mark.parametrize("source,target", PAIRS, ids=[f"{a}-to-{b}" for a, b in PAIRS])
def test_a_checkpoint_loads_bit_identical_into_another_world_and_layout(source, target, tmp_path_factory):
    def check(spec):
        path = str(tmp_path_factory.mktemp("ckpt") / "state")
        saved = run_on_world(_world(source), _save, spec, source, path)[0]
        loaded = run_on_world(_world(target), _load, spec, target, path)[0]
        _assert_identical(loaded, saved)

    if (source, target) in _SAVED_PARTIAL:
        shapes = {"params": [(5, 3), (7, 2), (2, 3, 5)], "extra_shape": (6, 5), "extra_dtype": "float32"}
        check = example({"seed": 5, **shapes, "layouts": _SAVED_PARTIAL[source, target]})(check)
    check = given(_states(source, target))(check)
    if settings.default.derandomize:  # (each pair its own examples: derandomized, all would draw the same ones)
        check = seed(PAIRS.index((source, target)))(check)
    settings(max_examples=3, deadline=None)(check)()


# -- plain DCP calls -------------------------------------------------------------------------------------------


def _plain_dcp(ranks, path, saving):
    p = st.placement("cpu", ranks)
    torch.manual_seed(0)
    model = nn.Linear(5, 7)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    if saving:
        model.to_global(p, {"weight": split(1), "bias": split(0)})
        dcp.save({"model": model.state_dict()}, checkpoint_id=path)
        return None
    with torch.no_grad():
        model.weight.zero_()
    model.to_global(p, {"weight": split(0), "bias": broadcast})
    dcp.load({"model": model.state_dict()}, checkpoint_id=path)
    return all(torch.equal(v.full_tensor(), want[k]) for k, v in model.state_dict().items())


def test_plain_dcp_save_and_load_reshard_global_tensors(tmp_path):
    path = str(tmp_path / "plain")
    run_on_world(3, _plain_dcp, [0, 1, 2], path, True)
    assert all(run_on_world(2, _plain_dcp, [0, 1], path, False))


def _plain_dcp_partial(path):
    x = st.tensor([1.0, 2.0], placement=st.placement("cpu", [0, 1]), sbp=partial("sum"))
    try:
        dcp.save({"x": x}, checkpoint_id=path)
    except BaseException as err:  # DCP raises CheckpointException, a BaseException, carrying each rank's error
        return str(err)


def test_plain_dcp_refuses_a_partial_tensor_and_says_what_to_do(tmp_path):
    for message in run_on_world(2, _plain_dcp_partial, str(tmp_path / "p")):
        assert "partial" in message and "sbp_torch.checkpoint.save" in message


# -- bad input ---------------------------------------------------------------------------------------------------


def _snapshot(model, optimizer):
    return st.full_state_dict(model), st.full_state_dict(optimizer)


def _mismatch(path, change):
    p = st.placement("cpu", [0, 1])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2)).to_global(p, {"0.*": split(0)})
    optimizer = torch.optim.AdamW(model.parameters())
    st.checkpoint.save({"model": model, "optim": optimizer}, path)
    torch.manual_seed(1)
    shapes = {"shape": (4, 5), "dtype": (4, 6)}.get(change, (4, 6))
    other = nn.Sequential(nn.Linear(*shapes), nn.Linear(6, 2))
    if change == "dtype":
        other[1].double()
    if change == "extra":
        other.append(nn.Linear(2, 2))
    other.to_global(p, {"0.*": split(0)})
    other_opt = torch.optim.AdamW(other.parameters())
    before = _snapshot(other, other_opt)
    state = {"model": other, "optim": other_opt}
    if change == "missing":
        state["more"] = torch.zeros(3)
    try:
        st.checkpoint.load(state, path)
    except CheckpointError as err:
        _assert_identical(_snapshot(other, other_opt), before)
        assert not other_opt.state  # the state made for the load is dropped again
        return str(err)
    return None


@pytest.mark.parametrize(
    "change,expected",
    [
        ("shape", "'model.0.weight': the checkpoint holds a (6, 4) torch.float32 tensor, the state holds a (5, 4)"),
        ("dtype", "'model.1.weight': the checkpoint holds a (2, 6) torch.float32 tensor, the state holds a (2, 6) "
         "torch.float64 tensor"),
        ("extra", "'model.2.weight' is missing from the checkpoint"),
        ("missing", "'more' is missing from the checkpoint"),
    ],
)  # fmt: skip
def test_a_mismatched_state_is_refused_on_every_rank_and_left_unchanged(change, expected, tmp_path):
    for message in run_on_world(2, _mismatch, str(tmp_path / "c"), change):
        assert message is not None and expected in message


def _optimizer_state_as_saved(path):
    """An optimizer ends with state for the parameters the checkpoint holds state for, as plain torch's
    ``load_state_dict`` leaves it: a fresh optimizer of a model with a parameter that took no gradient, and a
    pipeline rolled back to a checkpoint (each rank's optimizer holds state for its own stage's parameters)."""
    from sbp_torch.pipeline import Pipeline

    p, me = st.placement("cpu", [0, 1]), dist.get_rank()

    def made():
        torch.manual_seed(0)
        model = nn.ModuleDict({"used": nn.Linear(4, 4), "unused": nn.Linear(4, 4)}).to_global(p)
        return model, torch.optim.AdamW(model.parameters(), lr=0.01)

    model, optimizer = made()
    model["used"](st.ones(3, 4, placement=p, sbp=broadcast)).sum().backward()
    optimizer.step()
    st.checkpoint.save({"model": model, "optim": optimizer}, path + "/unused")
    fresh, fresh_optimizer = made()
    st.checkpoint.load({"model": fresh, "optim": fresh_optimizer}, path + "/unused")
    assert len(fresh_optimizer.state) == len(optimizer.state) == 2
    _assert_identical(st.full_state_dict(fresh_optimizer), st.full_state_dict(optimizer))
    torch.manual_seed(0)
    stages = [nn.Linear(4, 4).to_global(st.placement("cpu", [r])) for r in (0, 1)]
    pipe = Pipeline(stages, nn.functional.mse_loss, 2, "1f1b")
    optimizer = torch.optim.AdamW([q for stage in stages for q in stage.parameters()], lr=0.01)
    x, y = torch.randn(4, 4, generator=torch.Generator().manual_seed(1)), torch.ones(4, 4)

    def step():
        optimizer.zero_grad()
        pipe.step(x, y)
        optimizer.step()
        return [q.detach().to_local().clone() for q in stages[me].parameters()]

    step()
    own = {
        i: {name: (v.to_local() if v.is_global else v).clone() for name, v in entries.items()}
        for i, entries in optimizer.state_dict()["state"].items()
    }
    full = st.full_state_dict(optimizer)  # (each rank holds state for its own stage's parameters alone)
    st.checkpoint.save({"stages": nn.ModuleList(stages), "optim": optimizer}, path + "/pipeline")
    after_save = step()  # (moments as saved give these values again)
    step()
    st.checkpoint.load({"stages": nn.ModuleList(stages), "optim": optimizer}, path + "/pipeline")
    for got, want in zip(step(), after_save):
        assert torch.equal(got, want)
    return own, full


def test_an_optimizer_holds_state_for_the_parameters_the_checkpoint_does(tmp_path):
    (own_0, full), (own_1, nothing) = run_on_world(2, _optimizer_state_as_saved, str(tmp_path))
    assert sorted(own_0) == [0, 1] and sorted(own_1) == [2, 3] and nothing == {}
    # the full state on rank 0 holds every stage's parameters' state, each as the rank that steps it holds it
    _assert_identical(full["state"], {**own_0, **own_1})


def _extra_in_checkpoint(path):
    p = st.placement("cpu", [0, 1])
    st.checkpoint.save({"a": st.ones(3, placement=p, sbp=split(0)), "b": torch.ones(2)}, path)
    try:
        st.checkpoint.load({"a": st.zeros(3, placement=p, sbp=broadcast)}, path)
    except CheckpointError as err:
        return str(err)


def test_a_key_only_in_the_checkpoint_is_refused(tmp_path):
    for message in run_on_world(2, _extra_in_checkpoint, str(tmp_path / "c")):
        assert "'b' is in the checkpoint but not in the state loaded into" in message


def _save_one(path, value):
    p = st.placement("cpu", [0, 1])
    st.checkpoint.save({"x": st.tensor(value, placement=p, sbp=split(0))}, path)


def _load_one(path):
    x = st.zeros(4, placement=st.placement("cpu", [0, 1]), sbp=broadcast)
    try:
        st.checkpoint.load({"x": x}, path)
    except CheckpointError as err:
        return str(err)
    return x.full_tensor().tolist()


def _damage(path: Path, how: str) -> None:
    directory = path.resolve()
    data = directory / "rank1.data"
    if how == "flipped byte":
        raw = bytearray(data.read_bytes())
        raw[-1] ^= 0xFF
        data.write_bytes(bytes(raw))
    elif how == "cut file":
        data.write_bytes(data.read_bytes()[:-3])
    elif how == "no metadata":
        (directory / ".metadata").unlink()
    elif how == "code in metadata":
        marker = directory / "ran"
        (directory / ".metadata").write_bytes(pickle.dumps(_RunsCode(str(marker))))


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("how", ["flipped byte", "cut file", "no metadata", "code in metadata"])
def test_a_damaged_checkpoint_is_refused_with_a_clear_message(how, tmp_path):
    path = tmp_path / "c"
    run_on_world(2, _save_one, str(path), [1.0, 2.0, 3.0, 4.0])
    _damage(path, how)
    messages = run_on_world(2, _load_one, str(path))
    expected = {
        "flipped byte": "fail their checksum",
        "cut file": "the file ends early",
        "no metadata": "holds no finished checkpoint",
        "code in metadata": "posix.system, which is not metadata",
    }[how]
    assert all(isinstance(m, str) and expected in m for m in messages), messages
    assert not (path.resolve() / "ran").exists()


def _interrupted(path):
    _save_one(path, [1.0, 2.0, 3.0, 4.0])
    original = st.checkpoint._storage._as_bytes

    def failing(data):
        raise OSError("disk full (on rank 1 only)")

    if dist.get_rank() == 1:
        st.checkpoint._storage._as_bytes = failing
    try:
        _save_one(path, [5.0, 6.0, 7.0, 8.0])
    except CheckpointError as err:
        failed = str(err)
    else:
        failed = None
    finally:
        st.checkpoint._storage._as_bytes = original
    return failed, _load_one(path)


def test_an_interrupted_save_leaves_the_previous_checkpoint(tmp_path):
    for failed, loaded in run_on_world(2, _interrupted, str(tmp_path / "c")):
        assert "disk full" in failed
        assert loaded == [1.0, 2.0, 3.0, 4.0]


# -- reading only what is needed ----------------------------------------------------------------------------------


def _read_rows(path):
    p = st.placement("cpu", [0, 1])
    x = torch.arange(64 * 16, dtype=torch.float32).view(64, 16)
    writer = st.checkpoint.Writer(path, checksum_block=512)
    dcp.save({"x": st.tensor(x, placement=p, sbp=broadcast)}, storage_writer=writer)  # one stored box of 4 KiB
    target = st.zeros(64, 16, placement=p, sbp=split(0))
    reader = st.checkpoint.Reader(path)
    dcp.load({"x": target}, storage_reader=reader, planner=st.checkpoint.CheckedLoadPlanner())
    return reader.bytes_read, torch.equal(target.full_tensor(), x)


def test_a_rank_reads_only_the_rows_it_needs(tmp_path):
    # each of two ranks needs half of the stored box's rows: 2 KiB, four whole checksum blocks
    results = run_on_world(2, _read_rows, str(tmp_path / "c"))
    assert all(same for _, same in results)
    assert [read for read, _ in results] == [2048, 2048]


# -- the full state on one rank -----------------------------------------------------------------------------------


def _full_on_one_rank(path):
    p = st.placement("cpu", [[0, 1], [2, 3]])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3))
    want = {k: v.clone() for k, v in model.state_dict().items()}
    model.to_global(p, {"0.weight": (split(0), split(1)), "1.weight": (broadcast, split(1))})
    full = st.full_state_dict(model, rank=1)
    if dist.get_rank() != 1:
        return full == {}
    torch.save(full, f"{path}.pt")
    save_file(full, f"{path}.safetensors")
    again = torch.load(f"{path}.pt", weights_only=True)
    return all(
        torch.equal(again[k], v) and torch.equal(load_file(f"{path}.safetensors")[k], v) for k, v in want.items()
    )


def test_the_full_state_lands_on_one_rank_and_loads_without_pickled_code(tmp_path):
    assert all(run_on_world(4, _full_on_one_rank, str(tmp_path / "full")))


def _hugging_face_files(directory):
    zoo_model = next(m for m in dense.ZOO if m.name == "gpt_neox")
    layout = next(lay for lay in dense.LAYOUTS if lay.name == "tp")
    model, lay_out_batch = dense.lay_out(zoo_model, layout)
    training.train(model, dense.batches(zoo_model, 1), lay_out_batch)  # trained values, not initial ones
    full = st.full_state_dict(model)
    if dist.get_rank() != 0:
        return True
    dense.make(zoo_model).save_pretrained(directory, state_dict=full)  # safetensors files
    again = type(dense.make(zoo_model)).from_pretrained(directory).state_dict()
    return again.keys() == full.keys() and all(torch.equal(again[k], v) for k, v in full.items())


def test_the_full_state_saves_as_hugging_face_files_that_load_back(tmp_path):
    assert all(run_on_world(4, _hugging_face_files, str(tmp_path / "hf")))
