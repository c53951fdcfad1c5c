"""Attention: hybridsp against its peers, bytes on the wire, the ring's compute and the kernel-bound limit,
plan building and per-call overhead, sinks / MLA / soft-capping, masks, many tiny documents, linear attention."""
