"""Meshes without process groups, for tests where nothing communicates."""

from hybridsp.mesh._hybrid_mesh import HybridMesh, MeshShape


def mesh_at(ulysses, ring, r=0, u=0, layout="zigzag", dp=1, dp_rank=0) -> HybridMesh:
    """The mesh as rank (dp_rank, r, u) sees it; no process groups (nothing here communicates)."""
    shape = MeshShape(dp * ulysses * ring, ulysses, ring, layout=layout)
    groups = dict.fromkeys(["ulysses", "ring", "context", "data", "data_context"])
    return HybridMesh(shape, shape.rank_of(dp_rank, r, u), groups)
