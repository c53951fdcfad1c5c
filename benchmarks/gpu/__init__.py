"""The prepared accelerator check (not run on a GPU yet)."""
