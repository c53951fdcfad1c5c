"""The device mesh: DP x ring x Ulysses (x tensor) ranks with explicit process groups.

Public: :func:`init_mesh`, :class:`HybridMesh`, :class:`MeshShape`, :func:`padded_length` (the
shortest length the mesh's layout splits evenly) and :func:`choose_degrees`
(the ``"auto"`` rule), :func:`gather_placement` / :class:`Placement` (where the groups land on
hosts). Where the ranks run (the launcher's environment, hosts, the gloo
interface, the default process group) is :mod:`hybridsp.launch`. ``mesh.device_mesh`` /
``mesh.fsdp_mesh`` and ``init_mesh(device_mesh=)`` / :meth:`HybridMesh.from_device_mesh` are the mesh as a
PyTorch ``DeviceMesh``, both ways, over one set of process groups (``_device_mesh``).
"""

from hybridsp._types import KVComm, MeshOrder
from hybridsp.mesh._auto_degrees import choose_degrees
from hybridsp.mesh._hybrid_mesh import HybridMesh, MeshShape, init_mesh, padded_length
from hybridsp.mesh._placement import Placement, gather_placement

__all__ = [
    "HybridMesh",
    "KVComm",
    "MeshOrder",
    "MeshShape",
    "Placement",
    "choose_degrees",
    "gather_placement",
    "init_mesh",
    "padded_length",
]
