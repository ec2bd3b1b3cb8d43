"""A compiled step's program replayed as one CUDA graph (``compile_step(..., cuda_graphs=True)``).

A program of ``compile_step`` takes the learning rates, the state (parameters, gradients, buffers, optimizer state,
updated in place) and the parts of the step's tensor arguments. The first two are the same tensors call after call,
so a CUDA graph recorded over them stays valid: per call only the arguments are copied into the graph's own
tensors, and one launch replaces the program's hundreds. The graph's outputs are rewritten by every replay, so
they are handed out as copies that a caller may keep.
"""

from __future__ import annotations

import operator

import torch


class GraphNotRecorded(RuntimeError):
    """A program could not be recorded as a CUDA graph (it reads the host, draws from a generator on the host,
    ...)."""


class GraphedProgram:
    """``run`` (a compiled program: ``fixed`` leading inputs that keep their tensors from call to call, then the
    arguments) run once as it is, so that its kernels are loaded and tuned, then recorded as a CUDA graph in
    ``pool`` (shared by the programs of a step: they replay one at a time) and replayed. Where a fixed input is
    held by another tensor than at the recording (a loaded state dict), the graph is recorded again."""

    def __init__(self, run, fixed: int, pool):
        self.run, self.fixed_count, self.pool = run, fixed, pool
        self.warmed = False
        self.graph: torch.cuda.CUDAGraph | None = None
        self.fixed: list = []
        self.arguments: list[torch.Tensor] = []
        self.written: list[int] = []  # the arguments the program writes into: copied back after each replay
        self.outputs: list[torch.Tensor] = []

    def __call__(self, *flat):
        fixed, arguments = flat[: self.fixed_count], flat[self.fixed_count :]
        if not self.warmed:
            versions = [a._version for a in arguments]
            outputs = self.run(*flat)
            self.written = [i for i, (a, v) in enumerate(zip(arguments, versions)) if a._version != v]
            self.warmed = True
            return outputs
        if self.graph is None or not all(map(operator.is_, fixed, self.fixed)):
            self._record(fixed, arguments)
        for mine, given in zip(self.arguments, arguments):
            mine.copy_(given)
        self.graph.replay()
        for i in self.written:
            arguments[i].copy_(self.arguments[i])
        return [output.clone() for output in self.outputs]

    def _record(self, fixed, arguments) -> None:
        """Record the program over ``fixed`` and copies of ``arguments`` (its work is not done: the caller
        replays)."""
        self.graph, self.outputs = None, []  # (a recording that fails leaves nothing to replay)
        self.fixed = list(fixed)
        self.arguments = [torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device) for a in arguments]
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: a process group's watchdog thread may query its events while this thread records
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                self.outputs = list(self.run(*self.fixed, *self.arguments))
        except Exception as err:
            raise GraphNotRecorded(
                "compile_step(cuda_graphs=True) could not record the step's program as a CUDA graph: it ran, but "
                "does something a replay cannot repeat (reads a value, or draws random numbers through the host's "
                f"generator state): run it with cuda_graphs=False. ({type(err).__name__}: {err})"
            ) from err
        self.graph = graph


def keep_step_counts_on_the_device(optimizers) -> bool:
    """Set ``capturable=True`` on the optimizers' parameter groups that have the setting (Adam, AdamW, ...), so
    that they keep their step counts on the parameters' device: a count on the host is advanced by the host, which
    a replayed graph does not run. Counts already on the host move to their parameter's device. (Groups with
    parameters off CUDA are left alone: such a program is refused once traced.) Whether anything
    changed."""
    changed = False
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            if group.get("capturable", True) or any(p.device.type != "cuda" for p in group["params"]):
                continue
            group["capturable"], changed = True, True
            for param in group["params"]:
                state = optimizer.state.get(param, {})
                count = state.get("step")
                if isinstance(count, torch.Tensor) and count.device != param.device:
                    state["step"] = count.to(param.device)
    return changed


def refusal_of_inputs(examples: list, arguments: list) -> str | None:
    """Why a program with inputs ``examples`` (learning rates, state, then ``arguments``) cannot be replayed as a
    CUDA graph (None: it can, as far as its inputs tell)."""
    # (an argument is copied into a tensor of its strides: one whose elements share memory, expand()ed, has none)
    overlapping = [a for a in arguments if _may_overlap(a)]
    if overlapping:
        return (
            "compile_step(cuda_graphs=True) copies the step's arguments into the graph's own tensors, of the same "
            f"strides; an argument whose elements share memory (shape {tuple(overlapping[0].shape)}, strides "
            f"{overlapping[0].stride()}: an expand()) cannot be copied so: pass it contiguous"
        )
    devices = {t.device for t in examples if isinstance(t, torch.Tensor)}
    if not devices or any(d.type != "cuda" for d in devices) or len(devices) > 1:
        return (
            "compile_step(cuda_graphs=True) needs the step's state and tensor arguments on one CUDA device; here "
            f"they are on {sorted(map(str, devices)) or 'no device'}"
        )
    return None


def _may_overlap(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` may share memory: False where each dim's stride, in increasing order, passes
    the farthest element the smaller ones reach (a slice with gaps, a transpose), True otherwise (``expand``)."""
    reach = 0
    for stride, size in sorted((s, n) for n, s in zip(t.shape, t.stride()) if n > 1):
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


def refusal_of_program(collectives: bool) -> str | None:
    """Why a traced program cannot be replayed as a CUDA graph (None: it can)."""
    if collectives:
        return (
            "compile_step(cuda_graphs=True) replays programs without collectives (a one-rank placement, or layouts "
            "that need none); this program holds some, and recording a process group's collectives into a CUDA "
            "graph is not checked here: run it with cuda_graphs=False"
        )
    return None
