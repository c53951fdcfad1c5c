"""CommCounter: mesh.comm_counter records the calls made without an explicit counter."""

from __future__ import annotations

import pytest

import hybridsp
from hybridsp import CommCounter, hybrid_attn_func, init_mesh
from hybridsp.testing import run_distributed
from tests.helpers.references.attention import random_qkv

pytestmark = pytest.mark.distributed


def _counted(rank, world):
    mesh = init_mesh(2, 2)
    q, k, v, _ = (hybridsp.shard_sequence(t, mesh) for t in random_qkv(1, 32, 4, 2, 8))
    explicit = CommCounter()
    hybrid_attn_func(q, k, v, mesh=mesh, causal=True, counter=explicit)
    mesh.comm_counter = CommCounter()
    hybrid_attn_func(q, k, v, mesh=mesh, causal=True)
    return dict(explicit.bytes_sent), dict(mesh.comm_counter.bytes_sent)


def test_mesh_comm_counter_records_calls_without_a_counter():
    for explicit, through_mesh in run_distributed(_counted, 4):
        assert explicit == through_mesh and explicit["all_to_all"] > 0 and explicit["ring"] > 0
