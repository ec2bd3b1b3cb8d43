"""Check one OpInfo sample on global tensors against the same sample on plain tensors, forward and backward.

Used by ``opinfo_sweep.py``. Every rank runs the same code on the same values (samples are generated after
seeding with the entry's name), so every collective is matched; the caller makes the ranks agree on the
outcome before anything else runs.

A *layout* is backend-neutral: a tuple with one code per placement axis, ``"S<d>"`` (split/shard dim d),
``"B"`` (broadcast/replicate) or ``"P"`` (partial sum). ``Backend`` turns a full tensor and a layout into a
global tensor of sbp_torch or of PyTorch's DTensor.
"""

from __future__ import annotations

import fnmatch
import math
import random
import zlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

DEFAULT_TOL = (1e-4, 1e-4)  # (atol, rtol); an OpInfo's own float32 tolerance overrides raise it
WEIGHT_SEED = 7  # the fixed random weights of the backward loss


class SampleFailure(Exception):
    """A sample's global result differs from the plain one."""


# --- backends ---------------------------------------------------------------------------------------------


class SbpBackend:
    """sbp_torch: a placement of all ranks (1-D) or a 2-D grid; layouts map to split/broadcast/partial_sum."""

    name = "sbp"

    def __init__(self, mesh_shape: tuple[int, ...]):
        import sbp_torch as st

        self.placement = st.placement("cpu", torch.arange(math.prod(mesh_shape)).reshape(mesh_shape).tolist())
        self.ndim = len(mesh_shape)

    def distribute(self, full: torch.Tensor, layout: tuple[str, ...]) -> torch.Tensor:
        from sbp_torch.sbp import broadcast, partial_sum, split

        sbp = tuple(broadcast if c == "B" else partial_sum if c == "P" else split(int(c[1:])) for c in layout)
        return full.to_global(self.placement, (broadcast,) * self.ndim).to_global(sbp=sbp)

    @staticmethod
    def is_global(x) -> bool:
        import sbp_torch as st

        return isinstance(x, st.GlobalTensor)


class DTensorBackend:
    """PyTorch DTensor on a CPU DeviceMesh; layouts map to Shard(d)/Replicate()/Partial()."""

    name = "dtensor"

    def __init__(self, mesh_shape: tuple[int, ...]):
        from torch.distributed.device_mesh import DeviceMesh

        self.mesh = DeviceMesh("cpu", torch.arange(math.prod(mesh_shape)).reshape(mesh_shape))

    def distribute(self, full: torch.Tensor, layout: tuple[str, ...]) -> torch.Tensor:
        from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

        placements = [Replicate() if c == "B" else Partial() if c == "P" else Shard(int(c[1:])) for c in layout]
        return distribute_tensor(full, self.mesh, placements, src_data_rank=None)

    @staticmethod
    def is_global(x) -> bool:
        from torch.distributed.tensor import DTensor

        return isinstance(x, DTensor)


BACKENDS = {"sbp": SbpBackend, "dtensor": DTensorBackend}


# --- what to run --------------------------------------------------------------------------------------------


def entry_name(op) -> str:
    """The unique name of an op_db entry: ``name`` or ``name.variant``."""
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def stable_seed(*parts) -> int:
    """A seed from strings/ints that is the same in every process (``hash`` is salted per process)."""
    return zlib.crc32("/".join(map(str, parts)).encode())


# Families named by entry (fnmatch patterns), checked before the tag/class rules below: the families that
# the signature tables are organised by, where the aten tags say nothing.
FAMILY_BY_NAME = {
    "matmul": [
        "mm",
        "bmm",
        "addmm",
        "addmm.decomposed",
        "addmv",
        "addbmm",
        "baddbmm",
        "dot",
        "vdot",
        "mv",
        "addr",
        "matmul",
        "__rmatmul__",
        "einsum",
        "tensordot",
        "inner",
        "outer",
        "kron",
        "bmm.*",
    ],
    "indexing": [
        "gather",
        "scatter",
        "scatter_add",
        "scatter_reduce.*",
        "index_*",
        "take",
        "take_along_dim",
        "put",
        "__getitem__",
        "masked_select",
        "masked_scatter",
        "_unsafe_masked_index*",
        "*_scatter",
        "nonzero",
        "nonzero_static",
        "argwhere",
    ],
    "views": [
        "view",
        "view_as",
        "reshape",
        "reshape_as",
        "permute",
        "transpose",
        "t",
        "T",
        "mT",
        "H",
        "mH",
        "movedim",
        "squeeze",
        "squeeze.*",
        "unsqueeze",
        "flatten",
        "unflatten",
        "ravel",
        "expand",
        "expand_as",
        "broadcast_to",
        "broadcast_tensors",
        "narrow",
        "select",
        "slice",
        "split",
        "split.*",
        "unsafe_split",
        "split_with_sizes",
        "chunk",
        "unsafe_chunk",
        "tensor_split",
        "hsplit",
        "vsplit",
        "dsplit",
        "unbind",
        "cat",
        "stack",
        "hstack",
        "vstack",
        "dstack",
        "column_stack",
        "atleast_?d",
        "diagonal",
        "contiguous",
        "as_strided",
        "as_strided.*",
        "*_copy",
        "unfold",
        "repeat",
        "tile",
        "flip",
        "fliplr",
        "flipud",
        "roll",
        "rot90",
        "_chunk_cat",
    ],
    "factory/random": [
        "*_like",
        "new_*",
        "ones",
        "zeros",
        "full",
        "empty",
        "empty_strided",
        "empty_permuted",
        "eye",
        "scalar_tensor",
        "arange",
        "linspace*",
        "logspace*",
        "randn",
        "randint",
        "multinomial",
        "normal",
        "normal.*",
        "bernoulli",
        "cauchy",
        "exponential",
        "geometric",
        "log_normal",
        "uniform",
        "triu_indices",
        "tril_indices",
        "signal.windows.*",
    ],
    "reductions": [
        "max.reduction_*",
        "min.reduction_*",
        "aminmax",
        "logsumexp",
        "norm",
        "norm.*",
        "var_mean*",
        "std_mean*",
        "median",
        "nanmedian",
        "mode",
        "kthvalue",
        "trace",
        "dist",
    ],
    "nn": [
        "softmax*",
        "log_softmax*",
        "_softmax_backward_data",
        "torch.ops.aten._safe_softmax.default",
        "native_*_norm",
        "_native_batch_norm_legit",
        "_batch_norm_with_update",
    ],
}


def family(op) -> str:
    """The family of an op_db entry for the coverage table: by name (``FAMILY_BY_NAME``), then pointwise by the
    aten tag of the op's main overload, then by OpInfo class (ufuncs: pointwise, ReductionOpInfo: reductions),
    then by name prefix (linalg, fft, nn.functional), else "other"."""
    from torch.testing._internal.opinfo.core import BinaryUfuncInfo, ReductionOpInfo, SpectralFuncInfo, UnaryUfuncInfo

    name = entry_name(op)
    for fam, patterns in FAMILY_BY_NAME.items():
        if any(fnmatch.fnmatchcase(name, p) for p in patterns):
            return fam
    packet = getattr(torch.ops.aten, op.aten_name, None) if op.aten_name else None
    if isinstance(packet, torch._ops.OpOverloadPacket) and packet.overloads():
        names = packet.overloads()
        main = getattr(packet, "default" if "default" in names else names[0])  # e.g. max.default, not max.other
        if torch.Tag.pointwise in main.tags:
            return "pointwise"
    if isinstance(op, (UnaryUfuncInfo, BinaryUfuncInfo)):
        return "pointwise"
    if isinstance(op, ReductionOpInfo):
        return "reductions"
    if "linalg" in op.name:
        return "linalg"
    if isinstance(op, SpectralFuncInfo) or op.name.startswith("fft."):
        return "fft"
    if op.name.startswith("nn.functional."):
        return "nn"
    return "other"


# Entries a backend does not run, with why: they would cost more than the rest of a run together.
NOT_RUN = {
    "sbp": {},
    "dtensor": {"_batch_norm_with_update": "DTensor's sharding propagation takes about 100 s on it (2 ranks)"},
}

# Entries whose outputs hold uninitialised memory: only their shapes and dtypes are compared.
VALUES_UNDEFINED = ["empty", "empty_like", "empty_strided", "empty_permuted", "new_empty", "new_empty_strided"]


def tolerance(op) -> tuple[float, float]:
    """(atol, rtol): the largest float32 override the OpInfo declares for CPU (or any device), at least 1e-4."""
    from torch.testing._internal.common_device_type import toleranceOverride

    atol, rtol = DEFAULT_TOL
    for info in op.decorators:
        if getattr(info, "device_type", None) not in (None, "cpu"):
            continue
        decorators = getattr(info, "decorators", info)
        for d in decorators if isinstance(decorators, (list, tuple)) else [decorators]:
            if isinstance(d, toleranceOverride) and torch.float32 in d.d:
                atol, rtol = max(atol, d.d[torch.float32].atol), max(rtol, d.d[torch.float32].rtol)
    return atol, rtol


def layout_choices(t: torch.Tensor) -> list[str]:
    """The 1-D layouts a tensor may get: split on each dim of size >= 1, broadcast, partial sum (floating)."""
    if t.dim() == 0:
        return ["B"]
    choices = [f"S{d}" for d in range(t.dim()) if t.shape[d] >= 1] + ["B"]
    return choices + (["P"] if t.is_floating_point() else [])


# --- structure helpers --------------------------------------------------------------------------------------


def map_tensors(fn, obj):
    """``obj`` with every tensor inside lists, tuples and dicts replaced by ``fn(tensor)`` (in flatten order)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, list):
        return [map_tensors(fn, x) for x in obj]
    if type(obj) is tuple:  # not torch.Size or named tuples: they hold no tensors here
        return tuple(map_tensors(fn, x) for x in obj)
    if isinstance(obj, dict):
        return {k: map_tensors(fn, v) for k, v in obj.items()}
    return obj


def leaves(obj) -> list:
    """Tensors and other values of a (nested) output, flattened; tuple subclasses (return types) included."""
    if isinstance(obj, (list, tuple)):
        return [x for item in obj for x in leaves(item)]
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in leaves(v)]
    return [obj]


def describe(exc: BaseException) -> str:
    """Exception type and first line (two, when the first is only a heading): what the report shows."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {' '.join(lines[:2])[:300]}"


_FORMATS = {4: torch.channels_last, 5: torch.channels_last_3d}


def metadata_difference(got: torch.Tensor, want: torch.Tensor) -> str | None:
    """How a global output's strides or contiguity differ from the plain output's, or None. A dim of one element may
    have any stride (torch's own kernels disagree there), so only the others' are compared."""
    if got.shape != want.shape:
        return None  # (the values' comparison says so)
    strides = [(s, t) for n, s, t in zip(want.shape, got.stride(), want.stride()) if n != 1]
    if any(s != t for s, t in strides):
        return f"strides {tuple(got.stride())}, plain {tuple(want.stride())}"
    for memory_format in [torch.contiguous_format] + ([_FORMATS[want.dim()]] if want.dim() in _FORMATS else []):
        if got.is_contiguous(memory_format=memory_format) != want.is_contiguous(memory_format=memory_format):
            return f"is_contiguous({memory_format}) {got.is_contiguous(memory_format=memory_format)}, plain not"
    return None


def _compare(got, want, what: str, atol: float, rtol: float):
    try:
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol, equal_nan=True)
    except AssertionError as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        raise SampleFailure(f"{what}: {' '.join(lines[:3])[:300]}") from None


# --- one sample ---------------------------------------------------------------------------------------------


class _SeededOps(TorchDispatchMode):
    """Records whether any aten op run under it draws random numbers (tagged ``nondeterministic_seeded``, with a
    dropout probability other than 0 where it has one)."""

    def __init__(self):
        super().__init__()
        self.drew = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded in func.tags:
            names = [a.name for a in func._schema.arguments]
            bound = dict(zip(names, args), **kwargs)
            self.drew = self.drew or bound.get("dropout_p", bound.get("p", 1.0)) != 0
        return func(*args, **kwargs)


class SampleCheck:
    """One sample of one entry: the layouts it draws, then ``reference()``, ``forward()`` and ``backward()``.

    ``reference`` runs the sample on plain tensors (an exception there means the sample does not apply here,
    e.g. a CUDA-only op); it returns whether a backward check applies (the outputs have differentiable floating
    parts). ``forward`` runs it on global tensors and raises SampleFailure on a mismatch (any other exception is
    the op failing on global tensors). With ``values_defined`` False (``empty`` and friends) only shapes and
    dtypes are compared.
    """

    def __init__(
        self,
        op,
        sample,
        backend,
        mesh_ndim: int,
        seed: int,
        tol: tuple[float, float],
        values_defined: bool = True,
        compile_backend: str | None = None,
        partial_turn: int = 0,
    ):
        self.op, self.sample, self.backend, self.tol, self.seed = op, sample, backend, tol, seed
        self.values_defined = values_defined
        self.compile_backend = compile_backend  # run the global call through torch.compile with it
        rng = random.Random(seed)
        self.layouts = []  # one per tensor, in flatten order of (input, args, kwargs)
        self.tensors = []

        def draw(t):
            choices = layout_choices(t)
            self.layouts.append(tuple(rng.choice(choices) for _ in range(mesh_ndim)))
            self.tensors.append(t)
            return t

        map_tensors(draw, (sample.input, sample.args, sample.kwargs))
        # Besides the random draws, sample i makes the (i mod n)-th of its n tensors that may be partial a partial
        # sum on the first placement axis, so each argument position of an entry meets a partial input.
        may_be_partial = [i for i, t in enumerate(self.tensors) if "P" in layout_choices(t)]
        if may_be_partial:
            at = may_be_partial[partial_turn % len(may_be_partial)]
            self.layouts[at] = ("P",) + self.layouts[at][1:]

    def describe_layouts(self) -> str:
        return "[" + ", ".join("(" + ",".join(lay) + ")" for lay in self.layouts) + "]"

    def skip_reason(self) -> str | None:
        """Why the sample cannot be laid out at all (global tensors are dense), or None."""
        if any(t.layout != torch.strided for t in self.tensors):
            return "sparse input"
        return None

    def _clones(self):
        """Fresh leaves for the sample's tensors: one per distinct tensor (aliases stay aliases)."""
        memo = {}

        def clone(t):
            if id(t) not in memo:
                memo[id(t)] = t.detach().clone().requires_grad_(t.requires_grad)
            return memo[id(t)]

        args = map_tensors(clone, (self.sample.input, self.sample.args, self.sample.kwargs))
        return args, memo

    def _call(self, args, fn=None):
        inp, a, kw = args
        torch.manual_seed(self.seed)  # random ops draw the same numbers in both runs
        return (fn or self.op)(inp, *a, **kw)

    def _compiled_op(self):
        """The op through torch.compile (graph breaks allowed), compiled afresh for this sample: one code object
        serves every sample, and Dynamo would stop compiling it after its recompile limit."""
        import torch._dynamo

        torch._dynamo.reset()
        return torch.compile(lambda inp, *a, **kw: self.op(inp, *a, **kw), backend=self.compile_backend)

    def reference(self) -> bool:
        ref_args, self.ref_memo = self._clones()
        with _SeededOps() as seeded:
            self.ref_out = self._call(ref_args)
        # Where an op that draws random numbers gives other values, the random streams differ (docs/randomness.md:
        # bernoulli and dropout masks), not the op. (OpInfo's random entries reseed inside the op and restore the
        # generator, so its state cannot tell; the aten ops' tags can.)
        self.draws_random = seeded.drew
        return self._loss_inputs(self.ref_out) is not None

    def forward(self) -> None:
        plain_args, memo = self._clones()
        self.global_leaves = []  # (original id, global leaf) per tensor position
        layouts = iter(self.layouts)
        ids = {id(v): k for k, v in memo.items()}

        def distribute(t):
            g = self.backend.distribute(t.detach(), next(layouts))
            if t.requires_grad:
                g.requires_grad_(True)
            self.global_leaves.append((ids[id(t)], g))
            return g

        compiled = self._compiled_op() if self.compile_backend else None
        self.got_out = self._call(map_tensors(distribute, plain_args), compiled)
        self.metadata = [
            f"output {i}: {difference}"
            for i, (g, w) in enumerate(zip(leaves(self.got_out), leaves(self.ref_out)))
            if self.backend.is_global(g)
            and isinstance(w, torch.Tensor)
            and (difference := metadata_difference(g, w)) is not None
        ]
        self.got_full = self._gather(self.got_out)
        want, got = leaves(self.ref_out), leaves(self.got_full)
        if len(want) != len(got):
            raise SampleFailure(f"{len(got)} outputs, expected {len(want)}")
        atol, rtol = self.tol
        for i, (w, g) in enumerate(zip(want, got)):
            if isinstance(w, torch.Tensor):
                if not isinstance(g, torch.Tensor):
                    raise SampleFailure(f"output {i} is a {type(g).__name__}, expected a tensor")
                if not self.values_defined:
                    w, g = torch.zeros_like(w), torch.zeros_like(g)
                _compare(g.detach(), w.detach(), f"output {i}", atol, rtol)
            elif w != g and not (isinstance(w, float) and isinstance(g, float) and abs(w - g) <= atol + rtol * abs(w)):
                raise SampleFailure(f"output {i} is {g!r}, expected {w!r}")

    def _gather(self, out):
        """The output with every global tensor replaced by its full value (differentiable)."""
        if self.backend.is_global(out):
            return out.full_tensor()
        if isinstance(out, (list, tuple)):
            return type(out)([self._gather(x) for x in out])  # return types (structseqs) take a sequence too
        if isinstance(out, dict):
            return {k: self._gather(v) for k, v in out.items()}
        return out

    def _loss_inputs(self, out):
        """Positions of the differentiable floating outputs (after ``output_process_fn_grad``), or None."""
        processed = leaves(self.sample.output_process_fn_grad(out))
        picks = [
            i
            for i, o in enumerate(processed)
            if isinstance(o, torch.Tensor) and o.requires_grad and (o.is_floating_point() or o.is_complex())
        ]
        return picks or None

    def _loss(self, out, picks):
        processed = leaves(self.sample.output_process_fn_grad(out))
        gen = torch.Generator().manual_seed(WEIGHT_SEED)
        total = 0
        for i in picks:
            o = processed[i]
            w = torch.randn(o.shape, generator=gen, dtype=o.dtype)
            total = total + ((o * w).real.sum() if o.is_complex() else (o * w).sum())
        return total

    def reference_grads(self):
        """The reference gradients by original tensor id, or None when the plain backward itself fails."""
        picks = self._loss_inputs(self.ref_out)
        ref = [(k, t) for k, t in self.ref_memo.items() if t.requires_grad]
        try:
            grads = torch.autograd.grad(self._loss(self.ref_out, picks), [t for _, t in ref], allow_unused=True)
        except Exception:  # noqa: BLE001 - no plain backward (e.g. not implemented): nothing to compare
            return None
        return {k: g for (k, _), g in zip(ref, grads)}

    def backward(self, ref_grads):
        picks = self._loss_inputs(self.ref_out)
        inputs = [(k, g) for k, g in self.global_leaves if g.requires_grad]
        grads = torch.autograd.grad(self._loss(self.got_full, picks), [g for _, g in inputs], allow_unused=True)
        total = {}
        for (k, _), grad in zip(inputs, grads):
            if grad is None:
                continue
            full = grad.full_tensor() if self.backend.is_global(grad) else grad
            total[k] = full if k not in total else total[k] + full
        atol, rtol = self.tol
        for n, (k, want) in enumerate(ref_grads.items()):
            got = total.get(k)
            if want is None and got is None:
                continue
            want = torch.zeros_like(got) if want is None else want
            got = torch.zeros_like(want) if got is None else got
            _compare(got, want, f"gradient of tensor input {n}", atol, rtol)
