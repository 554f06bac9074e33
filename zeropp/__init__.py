"""zeropp: ZeRO++ communication kernels and collectives (qwZ, hpZ, qgZ) for ZeRO-3 training on slow networks."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # ``zeropp.initialize`` (the engine's entry point) and ``zeropp.Init`` (build a model on the meta device),
    # imported on first use so ``import zeropp`` stays light.
    if name in ("initialize", "Init"):
        from . import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'zeropp' has no attribute {name!r}")
