"""Integrations with other libraries, one module each; importing this package imports none of them.

``hybridsp.integrations.deepspeed``     DeepSpeed ZeRO over the data-parallel x context ranks.
``hybridsp.integrations.transformers``  Hugging Face transformers: the ``hybridsp`` attention
implementation and ``apply(model, mesh)`` for Llama-family causal LMs.
``hybridsp.integrations.trainer``       ``HybridSPTrainer`` / ``HybridSPMixin``: the Hugging Face
Trainer with hybrid sequence parallelism (also importable from ``...integrations.transformers``).
``hybridsp.integrations.vlm`` / ``vlm_batch`` / ``vlm_generate``  Qwen2-VL and Qwen2.5-VL: the language
model switched by ``apply``, ``shard_vlm_batch`` (3-D positions, vision work per rank), ``generate_vlm``.
"""
