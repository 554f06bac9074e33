"""A planner for the partition space (issue 25): given a model, a cluster and a batch, rank the plans (P/G/OS
sharding factors, qwZ/qgZ bits, hpZ, weight deltas, offload tier) by predicted step time, with its breakdown and the
memory per rank, and say which plans the engine runs today. ``python -m zeropp.plan``; docs/planner.md.

One file per responsibility: ``model`` (the model's units and FLOPs), ``cluster`` (links, memory, rates),
``space`` (the plans and what runs today), ``traffic`` (collectives and their bytes, from ``zeropp.comm.accounting``),
``cost`` (alpha-beta times of the algorithms, kernel times), ``memory`` (bytes per rank), ``search`` (prediction,
overlap, ranking, the reason), ``report`` (table and JSON).
"""

from .cluster import Cluster
from .model import LLAMA_PRESETS, ModelSpec, UnitSpec, from_hf_config, from_hf_dict, from_preset, from_sizes
from .search import Batch, Prediction, predict, rank, why
from .space import Partition, Plan, partitions, plans

__all__ = ["LLAMA_PRESETS", "Batch", "Cluster", "ModelSpec", "Partition", "Plan", "Prediction", "UnitSpec",
           "from_hf_config", "from_hf_dict", "from_preset", "from_sizes", "partitions", "plans", "predict", "rank",
           "why"]
