"""Deprecated package path (keep-old-paths): see hybridsp._deprecated."""
