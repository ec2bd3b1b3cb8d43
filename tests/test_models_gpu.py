"""Unmodified ``transformers`` models on a CUDA GPU, laid out by sbp_torch, with torch's default ``sdpa`` attention
(CUDA's fused attention kernels, which have SBP rules: ``_signatures/attention.py``). Skips without a GPU.

* Data parallel on two ranks sharing the GPU (gloo): the same losses as one process, and a step issues only the
  all-reductions that eager attention needs too (the gradient reduction and the loss's count): attention's inputs are
  never gathered.
* Grouped-query attention (Qwen2: 4 query heads, 2 key heads) in tensor parallel on two ranks: the heads stay split,
  no attention op takes the fallback, and the losses are one process's.
* One rank (a one-rank placement): a whole global step (forward, loss, backward, AdamW) runs under
  ``torch.cuda.set_sync_debug_mode("error")``: nothing in dispatch or boxing waits for the GPU; and the same step
  compiled with inductor gives one process's losses.
"""

from __future__ import annotations

import pytest
import torch

from world import run_on_world

pytest.importorskip("transformers")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

VOCAB, SEQ, STEPS = 96, 16, 3


def _gpt2(attention: str):
    import transformers as tf

    config = tf.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, attn_implementation=attention
    )  # fmt: skip
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"  # named: the default's warning is a call that a compiled forward cannot hold
    return model.cuda().train()


def _qwen2(attention: str):
    import transformers as tf

    config = tf.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attention_dropout=0.0, attn_implementation=attention
    )  # fmt: skip
    torch.manual_seed(0)
    model = tf.Qwen2ForCausalLM(config)
    model.loss_type = "ForCausalLM"
    return model.cuda().train()


def _batches(rows: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (rows, SEQ), generator=generator).cuda() for _ in range(STEPS)]


def _train(model, batches, lay_out=lambda t: t, observe=None) -> list[float]:
    """Losses of AdamW steps; ``observe`` (a context manager factory) wraps the last step."""
    import contextlib

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    losses = []
    for i, ids in enumerate(batches):
        ids = lay_out(ids)  # data loading: outside the observed step
        with observe() if observe and i == len(batches) - 1 else contextlib.nullcontext():
            loss = model(input_ids=ids, labels=ids).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        losses.append(float((loss.full_tensor() if hasattr(loss, "full_tensor") else loss).detach()))
    return losses


def _collectives_of_a_step(make, attention: str, ranks: list, plan=None, batch_sbp=None) -> tuple:
    """(one process's losses, the laid-out model's losses, the collectives of its last step, the ops that took the
    fallback) for ``make(attention)`` on a placement of ``ranks`` on the GPU."""
    import contextlib

    import sbp_torch as st
    from sbp_torch import _comm
    from sbp_torch._dispatch import _fallback
    from sbp_torch.sbp import broadcast, split

    batches = _batches(rows=6)
    reference = _train(make(attention), batches)
    placement = st.placement("cuda", ranks)
    model = make(attention).to_global(placement, plan)
    sbp = batch_sbp or split(0)
    kinds = []

    @contextlib.contextmanager
    def observe():
        with _comm.observing(lambda kind, group, nbytes: kinds.append(kind)):
            yield

    _fallback.warned_ops.clear()
    losses = _train(model, batches, lambda t: t.to_global(placement, broadcast).to_global(sbp=sbp), observe)
    return reference, losses, kinds, sorted(map(str, _fallback.warned_ops))


def sdpa_data_parallel(attention: str) -> tuple:
    return _collectives_of_a_step(_gpt2, attention, [0, 1])


def test_sdpa_data_parallel_issues_only_what_eager_attention_issues():
    sdpa = run_on_world(2, sdpa_data_parallel, "sdpa", _timeout=300)
    eager = run_on_world(2, sdpa_data_parallel, "eager", _timeout=300)
    for rank, ((want, got, kinds, fallbacks), (_, _, eager_kinds, _)) in enumerate(zip(sdpa, eager)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"losses on rank {rank}")
        assert sorted(kinds) == sorted(eager_kinds), f"sdpa issues {kinds}, eager attention {eager_kinds}"
        assert set(kinds) <= {"all-reduce(sum)"}, kinds
        assert not any("attention" in op for op in fallbacks), fallbacks


def gqa_tensor_parallel(attention: str) -> tuple:
    from sbp_torch.sbp import broadcast, split

    plan = {f"*.{n}.weight": split(0) for n in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")}
    plan |= {f"*.{n}.bias": split(0) for n in ("q_proj", "k_proj", "v_proj")}
    plan |= {f"*.{n}.weight": split(1) for n in ("o_proj", "down_proj")}
    return _collectives_of_a_step(_qwen2, attention, [0, 1], plan, broadcast)


def test_grouped_query_attention_stays_split_by_heads():
    """The step issues what it issues with eager attention: the row-parallel reductions and the embedding's
    gradient, gathered where it is accumulated (``_signatures/embedding.py``); no attention input moves."""
    sdpa = run_on_world(2, gqa_tensor_parallel, "sdpa", _timeout=300)
    eager = run_on_world(2, gqa_tensor_parallel, "eager", _timeout=300)
    for rank, ((want, got, kinds, fallbacks), (_, _, eager_kinds, _)) in enumerate(zip(sdpa, eager)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"losses on rank {rank}")
        assert sorted(kinds) == sorted(eager_kinds), f"sdpa issues {kinds}, eager attention {eager_kinds}"
        assert not any("attention" in op for op in fallbacks), fallbacks


def one_rank_step(compiled: bool) -> tuple:
    """(one process's losses, the global model's) on a one-rank placement; the last global step runs under the
    sync debug mode "error" (eager), or the model is compiled with inductor."""
    import contextlib

    import sbp_torch as st
    from sbp_torch.sbp import broadcast, split

    batches = _batches(rows=8)
    reference = _train(_gpt2("sdpa"), batches)
    placement = st.placement("cuda", [0])
    model = _gpt2("sdpa").to_global(placement)
    if compiled:
        torch._dynamo.reset()
        model.forward = torch.compile(model.forward, backend="inductor", fullgraph=True)

    @contextlib.contextmanager
    def no_host_synchronisation():
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")

    lay_out = lambda t: t.to_global(placement, broadcast).to_global(sbp=split(0))  # noqa: E731
    return reference, _train(model, batches, lay_out, None if compiled else no_host_synchronisation)


def test_a_global_step_on_one_gpu_waits_for_nothing():
    ((want, got),) = run_on_world(1, one_rank_step, False, _timeout=300)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_global_step_compiles_on_one_gpu():
    ((want, got),) = run_on_world(1, one_rank_step, True, _timeout=600)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def graphed_whole_step() -> tuple:
    """(one process's losses, those of ``compile_step(cuda_graphs=True)`` on a one-rank placement, the loss a
    replay returned, read again after later replays, the count the step kept in an argument, the graphs recorded):
    eight steps on batches sliced with gaps (``[:, :-1]``), the optimizer's state reloaded (held by new tensors:
    recorded again, ``capturable`` set back and made again) before the last two."""
    import sbp_torch as st
    from sbp_torch._api._step_graph import GraphedProgram
    from sbp_torch.sbp import broadcast, split

    batches = [ids[:, :-1] for ids in _batches(rows=8) * 2 + _batches(rows=8)[:2]]
    placement = st.placement("cuda", [0])
    runs = []
    for laid_out in (False, True):
        model = _gpt2("sdpa")
        if laid_out:
            model.to_global(placement)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
        count = torch.zeros((), device="cuda")

        def step(ids, count):
            if laid_out:
                ids = ids.to_global(placement, broadcast).to_global(sbp=split(0))
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
            count.add_(1)  # (written into an argument: copied back from the graph's own)
            return loss

        if laid_out:
            step = st.compile_step(step, model=model, optimizer=optimizer, cuda_graphs=True)
        losses = []
        for i, ids in enumerate(batches):
            if i == 6:
                state = optimizer.state_dict()
                for group in state["param_groups"]:
                    group["capturable"] = False  # (as a checkpoint of an eager run has it)
                optimizer.load_state_dict(state)
            losses.append(step(ids, count))
        runs.append([float((loss.full_tensor() if laid_out else loss).detach()) for loss in losses])
    graphs = [p.run for p in step.programs.values() if isinstance(p.run, GraphedProgram) and p.run.graph is not None]
    return runs[0], runs[1], float(losses[3].full_tensor()), float(count), len(graphs)


def test_a_whole_step_replayed_as_a_cuda_graph_matches_one_process():
    ((want, got, kept, count, graphs),) = run_on_world(1, graphed_whole_step, _timeout=600)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert kept == got[3], "a result of a replay was overwritten by a later one"
    assert count == len(got), "a write into an argument was lost"
    assert graphs == 1
