"""zeropp: ZeRO++ communication kernels and collectives (qwZ, hpZ, qgZ) for ZeRO-3 training on slow networks."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # ``zeropp.initialize`` (the engine's entry point), imported on first use so ``import zeropp`` stays light.
    if name == "initialize":
        from .engine import initialize

        return initialize
    raise AttributeError(f"module 'zeropp' has no attribute {name!r}")
