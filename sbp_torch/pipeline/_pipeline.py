"""Pipeline parallelism: stages on their own placements, run by the actor runtime (``_actors.py``).

Each stage is an ``nn.Module`` laid out on its own placement with ``Module.to_global`` (it may be data or tensor
parallel inside); each rank runs the actors of its own stages only. A stage's forward register holds each micro-batch's
saved activations until its backward releases them; its slot count is the schedule's quota (``SCHEDULES``), and the
backward reads it only when it is full or every forward has run. So the schedule emerges from the quotas (``m`` slots:
GPipe; ``p - s``: 1F1B); no loop here says which comes next. See docs/pipeline.md.

    pipe = Pipeline([stage0, stage1], F.cross_entropy, micro_batches=8, schedule="1f1b")
    loss = pipe.step(inputs, targets)    # gradients accumulated into the stages' parameters
    optimizer.step()
"""

import itertools
import traceback
import weakref

import torch
import torch.distributed as dist
from torch import nn

from .. import _comm as comm
from .._layout import GlobalMeta, broadcast, narrow_to, normalize_sbp, partials_as_broadcast
from .._tensor import GlobalTensor, gradient_sbp
from . import _actors as actors
from . import _transfer as transfer
from ._cuda_staging import Staging
from ._tied import TiedParameters
from ._timeline import Timeline

# schedule -> slots of a stage's forward register (saved activations), from (stages p, stage s, micro-batches m)
SCHEDULES = {
    "gpipe": lambda p, s, m: m,
    "1f1b": lambda p, s, m: min(m, p - s),
}

TRANSFER_SLOTS = 2  # activations / gradients received ahead of the actor that reads them
_pipeline_ids = itertools.count()


class PipelineError(RuntimeError):
    """A stage raised on some rank; every rank of the step raises this, with that rank's error."""


def _stage_placement(index: int, module: nn.Module):
    """The one placement of a stage's parameters and buffers; refuses plain tensors and mixed placements."""
    tensors = [(n, t) for n, t in itertools.chain(module.named_parameters(), module.named_buffers())]
    if not tensors:
        raise ValueError(f"stage {index} has no parameters or buffers to tell its placement")
    plain = [n for n, t in tensors if not isinstance(t, GlobalTensor)]
    if plain:
        raise ValueError(
            f"stage {index}: {plain[0]!r} is not global; lay the stage out with module.to_global(placement)"
        )
    placements = {}
    for name, t in tensors:
        placements.setdefault(t.placement, name)
    if len(placements) > 1:
        (p, a), (q, b) = list(placements.items())[:2]
        raise ValueError(f"stage {index} has parameters on two placements: {a!r} on {p} and {b!r} on {q}")
    return next(iter(placements))


def _check_placements(placements: list) -> None:
    """Stage placements a pipeline can run: one device type, every rank of the world in some stage, and a rank
    in several stages (interleaved virtual stages) only where each of those stages is on that rank alone and
    no two of them are consecutive."""
    world = dist.get_world_size()
    owners: dict = {}
    for s, p in enumerate(placements):
        if p.type != placements[0].type:
            raise ValueError(f"stage {s} is on {p.type} but stage 0 is on {placements[0].type}")
        for r in p.flat_ranks:
            owners.setdefault(r, []).append(s)
    for r, stages in owners.items():
        if len(stages) == 1:
            continue
        wide = [s for s in stages if placements[s].size > 1]
        if wide:
            raise ValueError(
                f"rank {r} is in the placements of stages {stages}, and stage {wide[0]} has several ranks: a "
                f"rank may hold several stages only if each is on that rank alone (the order of their actors "
                f"follows message timing, and a data or tensor parallel stage's collectives need one order on "
                f"all its ranks)"
            )
        for a, b in zip(stages, stages[1:]):
            if b == a + 1:
                raise ValueError(
                    f"rank {r} holds the consecutive stages {a} and {b}: put them in one module, or on different ranks"
                )
    idle = sorted(set(range(world)) - set(owners))
    if idle:
        raise ValueError(
            f"rank(s) {idle} of the {world}-rank world are in no stage's placement: "
            f"stage placements must cover every rank"
        )


def _staging(placement):
    """The device side of a CUDA pipeline (``_cuda_staging.Staging``), None on CPU; the default group needs a
    CPU backend, which carries the stage transfers."""
    if placement.type != "cuda":
        return None
    try:
        dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    except RuntimeError as err:
        raise ValueError(
            "a pipeline on CUDA sends its stage transfers through pinned host memory over the process group's "
            "CPU backend, and the default group has none: initialise it with one, e.g. "
            "init_process_group('cpu:gloo,cuda:nccl')"
        ) from err
    return Staging(placement.device())


def _part(full: torch.Tensor, placement, sbp) -> GlobalTensor:
    """The global tensor on ``placement``, laid out as ``sbp`` (default broadcast), whose logical value is
    ``full`` (the same on every rank)."""
    sbp = normalize_sbp(sbp or (broadcast,) * placement.ndim, placement, full.dim(), full.dtype)
    meta = GlobalMeta(tuple(full.shape), full.dtype, placement, sbp)
    coord = meta.placement.local_coord()
    local = full.new_empty((0,)) if coord is None else narrow_to(full, *meta.region(coord)).contiguous()
    return GlobalTensor(local, meta)


class Pipeline:
    """A training step over stages on their own placements, run by register quotas (see docs/pipeline.md).

    Args:
        stages: ``nn.Module``s, each laid out on one placement with ``to_global``; disjoint placements that
            together cover every rank of the world. Stage ``s`` feeds its output to stage ``s + 1``.
        loss_fn: ``loss_fn(output, targets) -> scalar``, the *mean* over the micro-batch.
        micro_batches: how many micro-batches a batch is split into (along dim 0). A batch that does not
            divide evenly is split into parts differing by one sample, and each micro-batch's loss is
            weighted by its size, so gradients and loss are those of the whole batch's mean loss.
        schedule: a key of ``SCHEDULES`` ("1f1b" or "gpipe").
        input_sbp / target_sbp: how the first stage's inputs / last stage's targets are laid out on their
            stage's placement (default broadcast).
        tied: groups of parameters on different stages that are one parameter of the model, each named
            ``"<stage index>.<parameter name>"``, e.g. ``[("0.embed.tokens.weight", "3.final.head.weight")]``
            for a GPT whose LM head is its token embedding. The copies take the first one's value now, and
            after every step each copy's gradient is the sum over the copies (``_tied.py``).

    Every rank builds the same stages and calls ``step`` with the same batch.
    """

    def __init__(
        self, stages, loss_fn, micro_batches: int, schedule: str = "1f1b", *, input_sbp=None, target_sbp=None, tied=()
    ):
        if not dist.is_initialized():
            raise RuntimeError("Pipeline needs torch.distributed to be initialized")
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}; known: {sorted(SCHEDULES)}")
        if not isinstance(micro_batches, int) or micro_batches < 1:
            raise ValueError(f"micro_batches must be a positive int, got {micro_batches!r}")
        self.stages = list(stages)
        self.placements = [_stage_placement(s, m) for s, m in enumerate(self.stages)]
        _check_placements(self.placements)
        self.tied = TiedParameters(self.stages, tied)
        self.loss_fn, self.micro_batches, self.schedule = loss_fn, micro_batches, schedule
        self.input_sbp, self.target_sbp = input_sbp, target_sbp
        me = dist.get_rank()
        self.local_stages = [s for s, p in enumerate(self.placements) if me in p]
        self._id, self._steps = next(_pipeline_ids), 0
        self.events, self.peak_activations = [], {}
        self._channels: dict = {}
        self._lanes = transfer.Lanes(_staging(self.placements[0]))
        weakref.finalize(self, self._lanes.close)  # also at exit, before the interpreter shuts down

    def quota(self, stage: int) -> int:
        """Forward register slots of ``stage``: the most micro-batches it keeps activations for."""
        return SCHEDULES[self.schedule](len(self.stages), stage, self.micro_batches)

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """Forward and backward of every micro-batch of ``(inputs, targets)`` (plain tensors, the same on every
        rank); gradients accumulate into the parameters' ``.grad``. Returns the batch's mean loss on every
        rank. Raises ``PipelineError`` on every rank if a stage raised on any."""
        n, m = inputs.shape[0], self.micro_batches
        if n < m:
            raise ValueError(f"a batch of {n} samples cannot be split into {m} micro-batches (each needs one)")
        if targets.shape[0] != n:
            raise ValueError(f"inputs have {n} samples but targets {targets.shape[0]}")
        # the batch goes to the device once, by the ranks that cut micro-batches from it
        if 0 in self.local_stages:
            inputs = inputs.to(self.placements[0].device())
        if len(self.stages) - 1 in self.local_stages:
            targets = targets.to(self.placements[-1].device())
        xs, ys = torch.tensor_split(inputs, m), torch.tensor_split(targets, m)
        weights = [x.shape[0] / n for x in xs]
        store = dist.distributed_c10d._get_default_store()
        key = f"sbp_torch/pipeline/{self._id}/{self._steps}/error"
        self._steps += 1

        def stop_if_failed():  # the runtime calls it while idle; another rank's stage may have failed
            if store.check([key]):
                raise _Stopped

        runtime = actors.Runtime(check=stop_if_failed)
        self.tied.begin_step()
        losses = []
        lanes = self._lanes
        lanes.begin_step(runtime.notify)
        # priority: every transfer before any compute (a transfer only hands work to its lane, and may unblock
        # another rank), then the later stages' compute first, so that earlier micro-batches finish first
        built = {stage: self._build(stage, lanes, xs, ys, weights, losses) for stage in reversed(self.local_stages)}
        for transfers, _, _ in built.values():
            for actor in transfers:
                runtime.add(actor)
        for _, computes, _ in built.values():
            for actor in computes:
                runtime.add(actor)
        failure, me = None, dist.get_rank()
        try:
            with comm.caller_stops_one_rank_failures():  # stopped below on every rank: the pipeline goes on
                runtime.run()
                lanes.settle()
        except _Stopped:
            failure = "stopped"
        except Exception as err:  # noqa: BLE001 - any stage error stops every rank
            failure = err
            where = getattr(err, "pipeline_stage", "/".join(map(str, self.local_stages)))
            store.set(
                key,
                f"stage {where} on rank {me} raised {type(err).__name__}: {err}\n"
                + "".join(traceback.format_exception(err)),
            )
            if dist.is_initialized() and any(len(self.placements[s].flat_ranks) > 1 for s in self.local_stages):
                # another rank of this rank's stages may wait in a collective that this rank will never join
                failed = f"{type(err).__name__} in pipeline stage {where}: {err}"
                comm.close_world(None if isinstance(err, comm.CollectiveError) else failed, err)
        self.events = runtime.events
        self.peak_activations = {stage: built[stage][2].peak for stage in self.local_stages}
        report = me == self.placements[-1].flat_ranks[0]
        flag = torch.tensor(
            [float(sum(losses)) if report and failure is None else 0.0, float(failure is not None)], dtype=torch.float64
        )
        try:
            # after a failure that closed some rank's groups (docs/faults.md), the ranks cannot stop in step: a
            # closed rank's transfers may hold its connections open, and the exchange would wait for the timeout
            if not dist.is_initialized() or (failure is not None and comm.posted_failures()):
                raise RuntimeError("process groups were closed after a failure")
            dist.all_reduce(flag)
        except RuntimeError as err:
            closed = comm.collective_failed(f"pipeline step {self._steps - 1}: the ranks could not stop in step", err)
            raise PipelineError(str(closed)) from (failure if isinstance(failure, Exception) else closed)
        if flag[1] > 0:
            lanes.drain()
            self._channels.clear()  # senders and receivers of an unfinished step guess different layouts next
            message = store.get(key).decode()
            if isinstance(failure, Exception):
                raise PipelineError(message) from failure
            raise PipelineError(message)
        self.tied.end_step()
        return float(flag[0])

    def _channel(self, boundary: int, direction: int) -> transfer.Channel:
        """The channel of activations (direction 0) or gradients (1) across ``boundary``, kept across steps."""
        return self._channels.setdefault((boundary, direction), transfer.Channel())

    def timeline(self) -> Timeline:
        """The last step's events of every rank (a collective: every rank calls it)."""
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, [(e.actor, e.kind, e.index, e.start, e.end) for e in self.events])
        return Timeline(gathered)

    def _build(self, s: int, lanes, xs, ys, weights, losses):
        """Stage ``s``'s actors and registers for one step: (its transfer actors, its forward and backward
        actors, its forward register), each list in priority order."""
        Actor, Pending, Register = actors.Actor, actors.Pending, actors.Register
        p, m = len(self.stages), self.micro_batches
        here, module = self.placements[s], self.stages[s]
        first, last = s == 0, s == p - 1
        forward = Register(f"forward s{s}", self.quota(s), read_when_full=True)
        act_in = Register("activation in", TRANSFER_SLOTS) if not first else None
        act_out = Register("activation out", TRANSFER_SLOTS) if not last else None
        grad_in = Register("gradient in", TRANSFER_SLOTS) if not last else None
        grad_out = Register("gradient out", TRANSFER_SLOTS) if not first else None

        def tag(boundary: int, direction: int, i: int) -> int:
            return ((boundary * 2 + direction) * m + i) * transfer.TAGS_PER_TRANSFER

        def receiving(name, src, boundary, direction, requires_grad, register):
            def body(i, _):
                channel = self._channel(boundary, direction)
                poll = transfer.recv(src, here, tag(boundary, direction, i), requires_grad, lanes, channel)
                return Pending(lambda: (lambda x: None if x is None else (x,))(poll()))

            return Actor(name, body, m, outputs=[register], kind="transfer")

        def sending(name, dst, boundary, direction, register):
            def body(i, inputs):
                channel = self._channel(boundary, direction)
                poll = transfer.send(inputs[0], dst, tag(boundary, direction, i), lanes, channel)
                return Pending(lambda: () if poll() else None)

            return Actor(name, body, m, inputs=[register], kind="transfer")

        def forward_body(i, inputs):
            x = _part(xs[i], here, self.input_sbp) if first else inputs[0]
            y = module(x)
            if last:
                loss = self.loss_fn(y, _part(ys[i], here, self.target_sbp))
                losses.append(loss.detach().full_tensor() * weights[i])  # read at the step's end: no sync here
                return ((x, loss * weights[i]),)
            return (x, y), _sendable(y)

        def backward_body(i, inputs):
            x, y = inputs[0]
            if last:
                y.backward()
            elif y.requires_grad:  # (a stage that trains nothing on an input that takes no gradient: none to pass)
                g = inputs[1].to_global(sbp=gradient_sbp(y.sbp))
                torch.autograd.backward(y, g)
            if first:
                return ()
            grad = x.grad if x.grad is not None else torch.zeros_like(x)
            return (_sendable(grad),)

        transfers = []
        if not first:
            transfers.append(receiving(f"recv activation s{s}", self.placements[s - 1], s - 1, 0, True, act_in))
        if not last:
            transfers.append(receiving(f"recv gradient s{s}", self.placements[s + 1], s, 1, False, grad_in))
            transfers.append(sending(f"send activation s{s}", self.placements[s + 1], s, 0, act_out))
        if not first:
            transfers.append(sending(f"send gradient s{s}", self.placements[s - 1], s - 1, 1, grad_out))
        computes = [
            Actor(
                f"forward s{s}",
                _in_stage(s, forward_body),
                m,
                inputs=[act_in] if act_in else [],
                outputs=[forward] + ([act_out] if act_out else []),
                kind="forward",
            ),
            Actor(
                f"backward s{s}",
                _in_stage(s, backward_body),
                m,
                inputs=[forward] + ([grad_in] if grad_in else []),
                outputs=[grad_out] if grad_out else [],
                kind="backward",
            ),
        ]
        return transfers, computes, forward


def _in_stage(stage: int, body):
    """``body``, whose errors carry the stage they came from (a rank may run several stages)."""

    def run(i, inputs):
        try:
            return body(i, inputs)
        except Exception as err:
            err.pipeline_stage = stage
            raise

    return run


def _sendable(t: GlobalTensor) -> GlobalTensor:
    """``t`` detached, with partial axes reduced inside its stage (every rank of the stage runs this in the
    same actor order), so that the pieces sent to the next stage do not overlap."""
    t = t.detach()
    sbp = partials_as_broadcast(t.sbp)
    return t if sbp == t.sbp else t.to_global(sbp=sbp)


class _Stopped(Exception):
    """Another rank's stage failed: leave the loop and join the step-end check."""
