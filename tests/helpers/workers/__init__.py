"""Functions run on every gloo rank by ``run_distributed`` (picklable by module path), shared by several tests:
the HF Trainer (:mod:`.trainer`), TRL SFT/DPO/LoRA (:mod:`.trl_sft`) and GRPO/RLOO (:mod:`.trl_rl`), MoE router
losses (:mod:`.moe`), linear-attention models (:mod:`.linear`), vision-language models (:mod:`.vlm`,
:mod:`.vlm_trainer`)."""
