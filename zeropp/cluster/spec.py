"""``ClusterSpec``: what emulated cluster to build (nodes, ranks per node, link rate) and how to fall back."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from .rates import parse_rate

FALLBACKS = ("auto", "error")


@dataclass(frozen=True)
class ClusterSpec:
    """An emulated cluster of ``nodes`` nodes of ``ranks_per_node`` ranks each.

    Args:
        nodes: number of nodes ``K`` (each one network namespace when shaped).
        ranks_per_node: ranks per node ``R`` (``torchrun --nproc-per-node``; exported as
            ``$ZEROPP_RANKS_PER_NODE`` so ``zeropp.comm.Topology`` finds the nodes).
        rate: each node's link rate, both directions, e.g. ``"1gbit"``; ``None`` builds the namespaces with
            unshaped links (veth speed: a baseline).
        unshaped: run without namespaces at all: one ``torchrun`` with ``K * R`` processes on the host's
            loopback, nodes emulated by rank groups only (``$ZEROPP_RANKS_PER_NODE = R``).
        fallback: what to do when namespaces cannot be built here (not root, no ``ip``/``tc``, a container
            without ``CAP_SYS_ADMIN``): ``"auto"`` runs unshaped with a note on stderr, ``"error"`` raises
            ``ClusterUnavailable``.
        port: rendezvous (``MASTER_PORT``) port. Default: 29500 inside the namespaces (a fresh network stack,
            nothing else listens there), a free port of the host when unshaped.
        burst: ``tbf`` bucket size in bytes (default: 4 ms of the rate, at least 64 KiB, so that the timer
            granularity and 64 KiB GSO segments do not throttle below the rate).
        latency: ``tbf`` queue length as the longest wait, in ms (longer queues drop fewer packets).
        subnet: the private IPv4 subnet of the nodes' links (node ``i`` gets its ``i + 1``-th host address);
            each run has its own switch namespace, so concurrent runs may use the same subnet.
        omp_threads: ``$OMP_NUM_THREADS`` for the ranks when the caller's environment does not set it.
    """

    nodes: int
    ranks_per_node: int
    rate: str | None = "1gbit"
    unshaped: bool = False
    fallback: str = "auto"
    port: int | None = None
    burst: int | None = None
    latency: float = 50.0
    subnet: str = "10.213.0.0/24"
    omp_threads: int = 1

    def __post_init__(self) -> None:
        for name in ("nodes", "ranks_per_node"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be a positive integer")
        if self.rate is not None:
            parse_rate(self.rate)
        if self.fallback not in FALLBACKS:
            raise ValueError(f"fallback={self.fallback!r} must be one of {FALLBACKS}")
        if self.port is not None and not (0 < int(self.port) < 65536):
            raise ValueError(f"port={self.port!r} is not a TCP port")
        if self.burst is not None and self.burst < 1500:
            raise ValueError(f"burst={self.burst!r} bytes is smaller than one packet")
        if not self.latency > 0:
            raise ValueError(f"latency={self.latency!r} ms must be positive")
        net = ipaddress.ip_network(self.subnet)
        if net.version != 4 or not net.is_private or net.num_addresses - 2 < self.nodes:
            raise ValueError(f"subnet={self.subnet!r} must be a private IPv4 subnet with room for {self.nodes} nodes")

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def rate_bps(self) -> float | None:
        """The link rate in bits per second (``None``: not shaped)."""
        return None if self.rate is None else parse_rate(self.rate)

    @property
    def burst_bytes(self) -> int:
        if self.burst is not None:
            return int(self.burst)
        bps = self.rate_bps or 1e9
        return max(64 * 1024, int(bps / 8 * 0.004))

    def addresses(self) -> list[str]:
        """The nodes' IPv4 addresses, node 0 first (node 0 hosts the rendezvous)."""
        hosts = ipaddress.ip_network(self.subnet).hosts()
        return [str(next(hosts)) for _ in range(self.nodes)]

    @property
    def shaped(self) -> bool:
        """Whether ``run`` would use namespaces here: not ``unshaped`` and namespaces can be built."""
        if self.unshaped:
            return False
        from .netns import shaping_available

        return shaping_available()[0]
