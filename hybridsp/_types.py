"""The names of every mode a call or a mesh takes, as ``Literal`` types (torch-free).

Each mode is a plain string at run time (what users write), checked against the tuple beside
its type, which is derived from the type so the two cannot drift apart.
"""

from __future__ import annotations

from typing import Literal, Union, get_args

KVComm = Literal["ring", "allgather"]
"""How K/V blocks travel in the ring group: point-to-point steps, or a chunked all-gather."""

LayoutName = Literal["zigzag", "contiguous", "balanced"]
"""A token layout by name (:mod:`hybridsp.layout`)."""

MeshOrder = Literal["ulysses_inner", "ring_inner"]
"""Which axis holds consecutive ranks."""

BackendName = Literal["auto", "torch", "flash", "reference"]
"""A local attention kernel by name (:mod:`hybridsp.kernels`)."""

PieceKind = Literal["full", "causal", "band"]
"""The mask of one block-plan piece (:mod:`hybridsp.layout`)."""

HeadChunks = Union[int, Literal["auto"]]
"""How many head groups one attention call runs in turn (an int G >= 1, or ``"auto"``; :mod:`hybridsp.attention`)."""

GenerationMode = Literal["plain", "sharded"]
"""How TRL's online trainers generate: the plain model, or hybridsp's sharded generation."""

KV_COMMS: tuple[str, ...] = get_args(KVComm)
LAYOUT_NAMES: tuple[str, ...] = get_args(LayoutName)
MESH_ORDERS: tuple[str, ...] = get_args(MeshOrder)
BACKEND_NAMES: tuple[str, ...] = get_args(BackendName)
GENERATION_MODES: tuple[str, ...] = get_args(GenerationMode)
