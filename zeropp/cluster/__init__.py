"""An emulated multi-node cluster on one Linux machine: K network namespaces ("nodes") joined by a bridge, each
node's link rate-limited with ``tc tbf``, one ``torchrun`` per node.

::

    python -m zeropp.cluster --nodes 2 --ranks-per-node 2 --rate 1gbit -- python -m zeropp.bench.training
    python -m zeropp.cluster --cleanup          # remove namespaces left by crashed runs

    from zeropp.cluster import ClusterSpec, run
    rc = run(ClusterSpec(nodes=2, ranks_per_node=2, rate="1gbit"), ["python", "-m", "zeropp.bench.training"])

Files: ``rates.py`` (rate strings), ``spec.py`` (``ClusterSpec``), ``netns.py`` (namespaces, bridge, veth pairs,
qdiscs, cleanup), ``launch.py`` (the torchruns and their supervision), ``__main__.py`` (the CLI). Building
namespaces needs root and iproute2; without them ``run`` falls back to an unshaped single-host run (nodes
emulated by rank groups) unless ``fallback="error"``.
"""

from .launch import Interrupted, free_port, rank_env, resolve_shaped, run, torchrun_args
from .netns import (
    ClusterUnavailable,
    Network,
    NetworkSetupError,
    Node,
    cleanup,
    emulated_network,
    list_namespaces,
    shaping_available,
)
from .rates import format_rate, parse_rate
from .spec import ClusterSpec

__all__ = [
    "ClusterSpec",
    "ClusterUnavailable",
    "Interrupted",
    "Network",
    "NetworkSetupError",
    "Node",
    "cleanup",
    "emulated_network",
    "format_rate",
    "free_port",
    "list_namespaces",
    "parse_rate",
    "rank_env",
    "resolve_shaped",
    "run",
    "shaping_available",
    "torchrun_args",
]
