"""Mixture-of-experts models for the MoE test and benchmark: unmodified ``transformers`` Mixtral, Qwen3-MoE and
DeepSeek-V3 in tiny configs (random weights, nothing downloaded, top-2 routing), and the layouts they are trained in
on 4 ranks.

Qwen3-MoE has 6 experts, so that 4 ranks hold uneven numbers of them (2, 2, 1, 1); Mixtral has 4. DeepSeek-V3 has
4 routed experts in 2 groups (the router keeps the best group per token), a shared expert, latent attention, and a
dense first layer, so one of its two layers is an MoE layer. ``implementation``
picks the experts' code in ``transformers``: ``"grouped_mm"`` (its default: tokens sorted by expert, one grouped
matmul) or ``"eager"`` (a Python loop over the experts that received tokens)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

VOCAB, SEQ = 64, 8
_COMMON = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, num_experts_per_tok=2, attention_dropout=0.0,
)  # fmt: skip


def _mixtral(implementation: str) -> torch.nn.Module:
    import transformers as tf

    config = tf.MixtralConfig(num_local_experts=4, **_COMMON)
    config._experts_implementation = implementation
    return tf.MixtralForCausalLM(config)


def _qwen3_moe(implementation: str) -> torch.nn.Module:
    import transformers as tf

    config = tf.Qwen3MoeConfig(num_experts=6, moe_intermediate_size=40, head_dim=8, **_COMMON)
    config._experts_implementation = implementation
    return tf.Qwen3MoeForCausalLM(config)


def _deepseek_v3(implementation: str) -> torch.nn.Module:
    import transformers as tf

    config = tf.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=2,
        topk_group=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4,
        qk_nope_head_dim=4, v_head_dim=8, max_position_embeddings=64, attention_dropout=0.0,
    )  # fmt: skip
    config._experts_implementation = implementation
    return tf.DeepseekV3ForCausalLM(config)


MODELS: dict[str, Callable[[str], torch.nn.Module]] = {
    "mixtral": _mixtral,
    "qwen3_moe": _qwen3_moe,
    "deepseek_v3": _deepseek_v3,
}


def make(name: str, implementation: str = "grouped_mm", dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The model with the same random weights on every rank."""
    torch.manual_seed(0)
    return MODELS[name](implementation).to(dtype).train()


@dataclass(frozen=True)
class Layout:
    """A way to lay out an MoE model on 4 ranks: the placement's ranks, the experts' SBP (every other parameter is
    broadcast) and the batch's."""

    name: str
    ranks: list
    experts: tuple
    batch: tuple
    shard: int | None = None  # the placement axis parameters are stored split over (Module.to_global's shard=)


def _layouts() -> dict[str, Layout]:
    from sbp_torch.sbp import broadcast, split

    return {
        "DP": Layout("DP", [0, 1, 2, 3], (broadcast,), (split(0),)),
        "EP": Layout("EP", [0, 1, 2, 3], (split(0),), (split(0),)),
        "DP x EP": Layout("DP x EP", [[0, 1], [2, 3]], (broadcast, split(0)), (split(0), split(0))),
        "sharded DP x EP": Layout("sharded DP x EP", [[0, 1], [2, 3]], (broadcast, split(0)), (split(0), split(0)), 0),
    }


LAYOUTS = _layouts()


def lay_out(model: torch.nn.Module, layout: Layout) -> Callable[[torch.Tensor], torch.Tensor]:
    """Lay ``model`` out by ``layout``, in place; return the function that lays out one batch tensor."""
    import sbp_torch as st
    from sbp_torch.sbp import broadcast

    placement = st.placement("cpu", layout.ranks)
    model.to_global(placement, {"*.experts.*": layout.experts}, shard=layout.shard)
    everywhere = (broadcast,) * placement.ndim
    return lambda t: t.to_global(placement, everywhere).to_global(sbp=layout.batch)


def batches(steps: int, rows: int, seed: int = 1234, seq: int = SEQ) -> list[dict]:
    """The same ``steps`` batches of ``rows`` sequences of ``seq`` token ids (labels are the inputs) on every rank."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (rows, seq), generator=generator)
        out.append({"input_ids": ids, "labels": ids})
    return out


def tensor_parallel(axis_sbp: Callable) -> dict:
    """The tensor-parallel plan of Mixtral and Qwen3-MoE: the attention Megatron-style (q, k and v column-parallel,
    o row-parallel) and the experts split by expert over the same axis, where the tokens are broadcast, so each rank
    adds its own experts' share (docs/moe.md). ``axis_sbp(s)`` turns the SBP of the tensor-parallel axis into the
    whole SBP; everything unnamed (embeddings, norms, routers) stays broadcast."""
    from sbp_torch.sbp import split

    plan = {f"*.self_attn.{name}.*": axis_sbp(split(0)) for name in ("q_proj", "k_proj", "v_proj")}
    plan["*.self_attn.o_proj.weight"] = axis_sbp(split(1))
    plan["*.experts.*"] = axis_sbp(split(0))
    return plan
