"""The model zoo: unmodified Hugging Face ``transformers`` models, trained as one process and laid out by sbp_torch.

Each ``ZooModel`` is a tiny config of one architecture family (random weights, nothing downloaded; dropout off, since
the random streams of dropout differ between one process and several ranks; everything else, caches included, as the
config's defaults), a batch maker, and the Megatron-style tensor-parallel plan as data: the linear layers split along
their output features (column-parallel: weight and bias ``split(0)``) and those split along their input features
(row-parallel: weight ``split(1)``), as glob patterns on the parameter names. Everything unnamed stays broadcast.

``LAYOUTS`` are the three ways a model is laid out (data parallel, tensor parallel, both on a 2x2 grid) on 4 ranks;
``zoo.training`` trains a model as the caller gives it, laid out or not. The zoo test (``tests/test_zoo.py``) and the
zoo benchmark (``benchmarks/suites/zoo.py``) share these.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

VOCAB, BATCH, SEQ = 64, 6, 7  # a batch of 6 splits unevenly over 4 ranks (the test's; the benchmark's is even)


@dataclass(frozen=True)
class ZooModel:
    name: str
    make: Callable  # () -> the model, random weights from the current seed
    batch: Callable  # (generator, rows) -> the keyword arguments of one training step, labels included
    column: tuple[str, ...]  # glob patterns of column-parallel linears (weight and bias split(0))
    row: tuple[str, ...]  # glob patterns of row-parallel linears (weight split(1))

    def tp_plan(self, axis_sbp: Callable) -> dict:
        """The tensor-parallel plan; ``axis_sbp(s)`` turns the SBP of the tensor-parallel axis into the whole SBP."""
        from sbp_torch.sbp import split

        plan = {}
        for layer in self.column:
            plan[f"*{layer}.weight"] = axis_sbp(split(0))
            plan[f"*{layer}.bias"] = axis_sbp(split(0))
        for layer in self.row:
            plan[f"*{layer}.weight"] = axis_sbp(split(1))
        return plan


def llama_config(**overrides):
    """A tiny Llama configuration (2 layers, hidden 32, 4 heads sharing 2 key/value heads), ``overrides`` applied."""
    import transformers as tf

    sizes = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    return tf.LlamaConfig(vocab_size=VOCAB, **{**sizes, **overrides})


def _tokens(generator, rows):
    ids = torch.randint(0, VOCAB, (rows, SEQ), generator=generator)
    return {"input_ids": ids, "labels": ids}


def _seq2seq(generator, rows):
    return {
        "input_ids": torch.randint(0, VOCAB, (rows, SEQ), generator=generator),
        "labels": torch.randint(0, VOCAB, (rows, SEQ - 2), generator=generator),
    }


def _images(generator, rows):
    return {
        "pixel_values": torch.randn(rows, 3, 16, 16, generator=generator),
        "labels": torch.randint(0, 5, (rows,), generator=generator),
    }


_COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, intermediate_size=64)


def _bert():
    import transformers as tf

    config = tf.BertConfig(num_hidden_layers=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **_COMMON)
    return tf.BertForMaskedLM(config)


def _gpt_neox():
    import transformers as tf

    config = tf.GPTNeoXConfig(num_hidden_layers=2, hidden_dropout=0.0, attention_dropout=0.0, **_COMMON)
    return tf.GPTNeoXForCausalLM(config)


def _opt():
    import transformers as tf

    config = tf.OPTConfig(
        vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, ffn_dim=64, num_hidden_layers=2,
        word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    return tf.OPTForCausalLM(config)


def _qwen2():
    import transformers as tf

    config = tf.Qwen2Config(num_hidden_layers=2, num_key_value_heads=2, attention_dropout=0.0, **_COMMON)
    return tf.Qwen2ForCausalLM(config)


def _t5():
    import transformers as tf

    config = tf.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return tf.T5ForConditionalGeneration(config)


def _vit():
    import transformers as tf

    config = tf.ViTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=16,
        patch_size=4, num_labels=5, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return tf.ViTForImageClassification(config)


ZOO = (
    ZooModel("bert", _bert, _tokens, (".query", ".key", ".value", ".intermediate.dense"), (".output.dense",)),
    ZooModel(
        "gpt_neox", _gpt_neox, _tokens, (".query_key_value", ".dense_h_to_4h"), (".attention.dense", ".dense_4h_to_h")
    ),
    ZooModel("opt", _opt, _tokens, (".q_proj", ".k_proj", ".v_proj", ".fc1"), (".out_proj", ".fc2")),
    ZooModel(
        "qwen2", _qwen2, _tokens, (".q_proj", ".k_proj", ".v_proj", ".gate_proj", ".up_proj"), (".o_proj", ".down_proj")
    ),
    ZooModel("t5", _t5, _seq2seq, (".q", ".k", ".v", ".wi"), (".o", ".wo")),
    ZooModel(
        "vit",
        _vit,
        _images,
        (".query", ".key", ".value", ".intermediate.dense"),
        (".attention.output.dense", ".output.dense"),
    ),
)


@dataclass(frozen=True)
class Layout:
    """How a model and its batch are laid out on 4 ranks: the placement's ranks, the model's plan, the batch's SBP."""

    name: str
    ranks: list
    plan: Callable  # (ZooModel) -> the sbp argument of Module.to_global
    batch_sbp: tuple


def _layouts() -> tuple:
    from sbp_torch.sbp import broadcast, split

    return (
        Layout("dp", [0, 1, 2, 3], lambda m: None, (split(0),)),
        Layout("tp", [0, 1, 2, 3], lambda m: m.tp_plan(lambda s: (s,)), (broadcast,)),
        Layout("2d", [[0, 1], [2, 3]], lambda m: m.tp_plan(lambda s: (broadcast, s)), (split(0), broadcast)),
    )


LAYOUTS = _layouts()


def batches(model: ZooModel, steps: int, dtype: torch.dtype = torch.float32, rows: int = BATCH) -> list[dict]:
    """The same ``steps`` batches of ``rows`` rows on every rank (a seeded generator of their own); floating tensors
    in ``dtype``."""
    generator = torch.Generator().manual_seed(1234)
    cast = lambda t: t.to(dtype) if t.is_floating_point() else t  # noqa: E731
    return [{k: cast(v) for k, v in model.batch(generator, rows).items()} for _ in range(steps)]


def make(model: ZooModel, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The model with the same random weights on every rank, in ``dtype``."""
    torch.manual_seed(0)
    return model.make().to(dtype).train()


def lay_out(
    zoo_model: ZooModel, layout: Layout, dtype: torch.dtype = torch.float32
) -> tuple[torch.nn.Module, Callable]:
    """(The model laid out by ``layout``, the function that lays out one batch tensor.)"""
    import sbp_torch as st
    from sbp_torch.sbp import broadcast

    placement = st.placement("cpu", layout.ranks)
    model = make(zoo_model, dtype).to_global(placement, layout.plan(zoo_model))
    everywhere = (broadcast,) * placement.ndim

    def batch_to_global(t: torch.Tensor) -> torch.Tensor:
        return t.to_global(placement, everywhere).to_global(sbp=layout.batch_sbp)

    return model, batch_to_global
