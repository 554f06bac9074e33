"""zeropp: ZeRO++ communication kernels and collectives (qwZ, hpZ, qgZ) for ZeRO-3 training on slow networks."""

__version__ = "0.1.0"
