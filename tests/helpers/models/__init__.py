"""Tiny Hugging Face models and their batches: the builder every test uses (:mod:`.tiny`), switched and sharded
forward passes (:mod:`.switched`), packed rows (:mod:`.packed`), hybrid linear-attention models (:mod:`.linear`),
generation prompts and references (:mod:`.generation`). The family table is tests/helpers/families.py."""
