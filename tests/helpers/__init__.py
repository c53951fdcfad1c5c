"""What several test modules share (tests/README.md). No test module imports another test module; anything a
second test needs lives here.

- ``references/``: independent ground truth (float64 attention, masked attention, the mask cases).
- ``models/``: tiny Hugging Face models, batches and their one-process references.
- ``workers/``: what ``run_distributed`` runs on each rank for the Trainer, TRL, MoE, linear and VLM tests.
- here: ``paths`` (where things are), ``mesh`` (meshes without process groups), ``preload`` (what the process pool
  imports once), ``netns`` (two hosts on one machine), ``families`` (the family table docs/model-support.md is
  generated from), ``packs`` (packed rows, also for benchmarks), ``flash_attn_standin`` (a CPU stand-in for
  flash-attn's interface), ``deepspeed_engines`` and ``trainer_configs`` (DeepSpeed engines and configs).
"""
