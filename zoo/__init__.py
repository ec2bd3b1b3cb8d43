"""Unmodified Hugging Face ``transformers`` models in tiny configs, with the layouts they are trained in.

* ``zoo.dense``: six architectures (BERT, GPT-NeoX, OPT, Qwen2, T5, ViT), their tensor-parallel plans, the DP, TP
  and 2-D layouts on 4 ranks;
* ``zoo.moe``: Mixtral and Qwen3-MoE, and their DP, EP and DP x EP layouts;
* ``zoo.training``: how both train (AdamW steps on the model's loss, laid out or as one process);
* ``zoo.gpt``: the GPT example and a ``transformers`` GPT-2 on one device, laid out by plain PyTorch, sbp_torch or
  DTensor, and the step compiled whole (the GPU benchmark's models; the host-read tests run them small).

Why a top-level package: the tests (``tests/test_zoo.py``, ``test_moe.py``, ``test_checkpoint.py``,
``test_host_reads.py``) check the models against one process and the benchmark suites (``benchmarks/suites/zoo.py``,
``moe.py``, ``plan.py``, ``sharded.py``, ``gpt_cuda.py``) time the same models, so they belong to neither. Both run
from the repository root, where ``import zoo`` finds this folder; it is not part of the installed ``sbp_torch``.
"""
