"""Whole jobs: torch.compile of the main job's model, decoding, the HF Trainer's gradient scale, the soak."""
