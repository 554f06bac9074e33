"""ZeRO stages 1, 2 and 3 with ZeRO++'s switches, behind DeepSpeed's ``initialize`` / ``backward`` / ``step``.

One file per responsibility:

* ``policy.py``: which modules form units and which unit owns each parameter;
* ``unit.py``: ``Unit``, a unit's flat sharded parameters with its fp32 master and gradient shards;
* ``rules.py``: ``zeropp.rules``, each parameter's formats and the units split by format;
* ``collectives.py``: ``Collectives``, the only place the engine communicates (through ``zeropp.comm``);
* ``hooks.py``: the stage-3 gather/free state machine and the "unit's gradients are complete" trigger;
* ``loss_scaler.py``: ``LossScaler``, fp16 dynamic loss scaling (DeepSpeed's rules);
* ``optimizer.py``: ``PartitionedOptimizer``, AdamW/Adam/SGD on the shards (torch's fused arithmetic; native on CPU);
* ``engine.py``: ``ZeroEngine``, the forward/backward/step protocol;
* ``reuse.py``: which stage-3 units stay whole (persistence threshold, reuse distance: DeepSpeed's ``stage3_*``);
* ``prefetch.py``: ``Prefetcher``, the stage-3 look-ahead gathers;
* ``scheduler.py``: DeepSpeed's learning-rate schedules (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle);
* ``monitor.py``: ``steps_per_print`` and ``wall_clock_breakdown``, the progress line;
* ``host_memory.py``: returning the freed heap to the OS after CPU steps, when it piles up;
* ``materialize.py``: ``Init`` and the unit-by-unit materialisation of a model built on the meta device;
* ``gathered.py``: whole parameters on demand (``gathered_parameters``, ``zero.GatheredParameters``,
  ``model.state_dict()`` at stage 3);
* ``entry_check.py``: ``EntryCheck``, a collective call (a save, ``state_dict`` at stage 3) made by fewer ranks
  raises ``EngineUsageError`` within ``zeropp.entry_check_timeout`` instead of hanging;
* ``checkpoint.py``: sharded save/load with torch.distributed.checkpoint (any world size), the consolidated state dict;
* ``checkpoint_files.py``: a checkpoint's files: atomic commit of a save, the sha256 manifest, validation, ``latest``;
* ``initialize.py``: ``initialize``, the entry point (also ``zeropp.initialize``);
* ``offload.py``: ``OptimizerOffload``, where each unit's optimizer side lives (device, CPU, NVMe swap files);
* ``param_offload.py``: ``ParamOffload``, stage 3's compute shards in host memory or NVMe swap files;
* ``placement.py``: ``memory_budget``, each unit's optimizer tier chosen from what the first step measured;
* ``weight_deltas.py``: ``WeightDeltas``, the hpZ secondary kept across steps and updated by quantized weight changes
  (or, at the resident point ``(p, W, W)``, by the exact stepped shards).
"""

from .checkpoint import CheckpointError, consolidate
from .engine import EngineUsageError, NonFiniteGradientError, ZeroEngine
from .initialize import initialize
from .loss_scaler import LossScaler
from .materialize import Init, reset_parameters_by_unit, unit_seed
from .optimizer import PartitionedOptimizer
from .policy import UnitPlan, UnitPolicy, default_unit_modules, plan_units, units_of_type
from .unit import Unit

__all__ = [
    "CheckpointError",
    "EngineUsageError",
    "Init",
    "LossScaler",
    "NonFiniteGradientError",
    "PartitionedOptimizer",
    "Unit",
    "UnitPlan",
    "UnitPolicy",
    "ZeroEngine",
    "consolidate",
    "default_unit_modules",
    "initialize",
    "plan_units",
    "reset_parameters_by_unit",
    "unit_seed",
    "units_of_type",
]
