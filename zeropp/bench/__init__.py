"""Benchmark entry points: ``python -m zeropp.bench.collectives`` (collective bandwidth, run under torchrun)."""
