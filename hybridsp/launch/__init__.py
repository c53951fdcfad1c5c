"""Where the ranks run: the launcher's environment, hosts and groups, the gloo interface, and the
process group scripts use without DeepSpeed. Nothing here knows the mesh (:mod:`hybridsp.mesh`
reads the node size and the default timeout from here).

Public: :func:`init_process_group` (a world of one without a launcher; gloo interface, timeout),
:func:`read_launch_env` / :class:`LaunchEnv`, :func:`ranks_per_node`, :func:`choose_gloo_interface`. Where the mesh's groups land on hosts is
:func:`hybridsp.mesh.gather_placement`.
"""

from hybridsp.launch._gloo_interface import choose_gloo_interface
from hybridsp.launch._launcher import LaunchEnv, ranks_per_node, read_launch_env
from hybridsp.launch._process_group import init_process_group

__all__ = ["LaunchEnv", "choose_gloo_interface", "init_process_group", "ranks_per_node", "read_launch_env"]
