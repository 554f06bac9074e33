"""DeepSpeed-compatible training configuration, parsed and validated once, at ``zeropp.initialize``.

``load_config(config, world_size)`` takes a dict or the path of a JSON file and returns a frozen ``Config``.
Keys are spelled as DeepSpeed spells them, with DeepSpeed's defaults::

    {
      "train_batch_size": 32,                     # = micro batch * gradient_accumulation_steps * world size
      "train_micro_batch_size_per_gpu": 4,
      "gradient_accumulation_steps": 2,
      "gradient_clipping": 1.0,                   # clip by global norm; 0 (default) = off
      "steps_per_print": 10,                      # rank 0 prints one progress line every N optimizer steps
      "wall_clock_breakdown": false,              # add forward/backward/step times (ms) to that line
      "communication_data_type": null,            # dtype of the exact gradient reduce-scatter (null: compute dtype)
      "bf16": {"enabled": false},                 # also read under DeepSpeed's older name "bfloat16"
      "fp16": {"enabled": false, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
               "hysteresis": 2, "min_loss_scale": 1},           # loss_scale 0 = dynamic
      "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8,
                                                 "weight_decay": 0.01}},
      "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3,
                                                    "warmup_num_steps": 1000, "warmup_type": "log"}},
      "zero_optimization": {
        "stage": 3,                               # 1, 2 or 3
        "zero_quantized_weights": false,          # qwZ (stages 1-3: every weight all-gather)
        "zero_quantized_gradients": false,        # qgZ (stages 1-3: every gradient reduce-scatter)
        "zero_hpz_partition_size": 1,             # hpZ, stage 3: ranks holding the secondary shard (1 = off);
                                                  # must divide the ranks per node (checked at initialize)
        "reduce_bucket_size": 500000000,
        "stage3_prefetch_bucket_size": 50000000,
        "overlap_comm": false,                    # default true at stage 3, as DeepSpeed
        "stage3_max_live_parameters": 1000000000,
        "stage3_max_reuse_distance": 1000000000,
        "stage3_param_persistence_threshold": 100000,
        "stage3_model_persistence_threshold": sys.maxsize,
        "stage3_gather_16bit_weights_on_model_save": false,
        "offload_optimizer": {"device": "none", "nvme_path": null, "pin_memory": true, "buffer_count": 4,
                              "pipeline_read": false, "pipeline_write": false, "fast_init": false, "ratio": 1.0},
        "offload_param": {"device": "none", "nvme_path": null, "pin_memory": true, "buffer_count": 5,
                          "buffer_size": 100000000, "max_in_cpu": 1000000000},
        "zeropp": {"weight_bits": 8, "gradient_bits": 4, "block_size": 128, "error_feedback": false,
                   "nonfinite_gradients": "skip", "entry_check_timeout": 300,
                   "memory_budget": null}           # e.g. {"device": 40e9, "cpu": 100e9}
      },
      "aio": {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": false,
              "overlap_events": true, "use_gds": false}
    }

Batch sizes follow DeepSpeed's rules: any two of ``train_batch_size``, ``train_micro_batch_size_per_gpu`` and
``gradient_accumulation_steps`` determine the third; ``train_batch_size`` alone means one accumulation step;
``train_micro_batch_size_per_gpu`` alone means one accumulation step too; all three must agree.

Optimizers (``optimizer.type``, case-insensitive), with torch.optim's parameter names and defaults:

* ``AdamW``: ``lr`` (1e-3), ``betas`` ([0.9, 0.999]), ``eps`` (1e-8), ``weight_decay`` (0.01);
* ``Adam``: the same with ``weight_decay`` 0 and, as in DeepSpeed, ``adam_w_mode`` (default **true**: the weight
  decay is decoupled, i.e. AdamW); ``adam_w_mode: false`` gives torch.optim.Adam's L2 penalty;
* ``SGD``: ``lr`` (1e-3), ``momentum`` (0), ``dampening`` (0), ``weight_decay`` (0), ``nesterov`` (false).

The implementation switches ``torch_adam``, ``fused`` and ``foreach`` are accepted and change nothing (the arithmetic
is torch.optim's single-tensor one); ``bias_correction`` is accepted as true only.

Schedulers (``scheduler.type``; ``zeropp.engine.scheduler`` has the formulas), DeepSpeed's types with DeepSpeed's
parameter names and defaults, stepped once per applied optimizer step (``engine.step()`` at an accumulation
boundary; not on an fp16-skipped step, as DeepSpeed):

* ``WarmupLR``: ``warmup_min_lr`` (0), ``warmup_max_lr`` (the optimizer's lr), ``warmup_num_steps`` (1000),
  ``warmup_type`` (``"log"`` or ``"linear"``; DeepSpeed falls back to log on anything else, zeropp rejects it);
* ``WarmupDecayLR``: the same plus ``total_num_steps`` (required) and ``warmup_max_lr`` 0.001: linear decay to
  ``warmup_min_lr`` at ``total_num_steps``;
* ``WarmupCosineLR``: ``total_num_steps`` (required), ``warmup_min_ratio`` (0), ``warmup_num_steps`` (1000),
  ``cos_min_ratio`` (1e-4), ``warmup_type`` (log): ratios of each group's lr at construction;
* ``OneCycle``: ``cycle_min_lr``, ``cycle_max_lr`` (required), ``decay_lr_rate`` (0), ``cycle_first_step_size``
  (2000), ``cycle_second_step_size`` (= first), ``cycle_first_stair_count`` (0), ``cycle_second_stair_count``
  (= first), ``decay_step_size`` (0), ``cycle_momentum`` (true: Adam's ``betas`` become ``(mom, 0.99)``, as
  DeepSpeed; ignored with a warning for SGD), ``cycle_min_mom`` (0.8), ``cycle_max_mom`` (0.9),
  ``decay_mom_rate`` (0).

Each also takes ``last_batch_iteration`` (-1: start from the beginning).

``communication_data_type`` (``"fp32"``, ``"fp16"``, ``"bf16"``; also ``"float32"``, ``"float"``, ``"float16"``,
``"half"``, ``"bfloat16"``; null: DeepSpeed's default, the compute dtype): the dtype in which the exact (not qgZ)
gradient reduce-scatter sends and sums. qgZ always quantizes from and sums in fp32.

DeepSpeed's stage-3 tuning keys, with DeepSpeed's defaults and their meaning in zeropp, where a unit (a group of
parameters gathered together, ``zeropp.engine.policy``) plays the part of DeepSpeed's parameter:

* ``stage3_max_live_parameters``: at most this many elements of gathered units held at once beyond the one in use
  (look-ahead and units kept for reuse);
* ``stage3_max_reuse_distance``: a unit whose next use (in the recorded order of the previous step) comes within
  this many gathered elements is kept gathered instead of freed, e.g. the last unit of the forward, whose
  backward follows at once;
* ``stage3_param_persistence_threshold``: a unit with fewer elements than this stays gathered for the whole run
  (never freed, no re-gather); ``stage3_model_persistence_threshold``: the total elements of such persistent
  units is at most this;
* ``stage3_gather_16bit_weights_on_model_save``: ``engine.save_16bit_model`` at stage 3 gathers the whole weights
  and writes them; false (DeepSpeed's default) writes nothing and warns, as DeepSpeed
  (``stage3_gather_fp16_weights_on_model_save``, DeepSpeed's older spelling, is read too);
* ``allgather_bucket_size`` (5e8) and ``sub_group_size`` (1e9) are read and have no effect: the stage-1/2 weight
  gather runs unit by unit, and the optimizer steps each unit's shard in turn.

Offload (``zeropp.config.offload``), DeepSpeed's blocks with DeepSpeed's keys, defaults and meanings; the engine's
tiers: ``zeropp.engine.offload`` and ``zeropp.engine.param_offload``. **This build runs ``offload_optimizer``
(``"cpu"`` and ``"nvme"``, stages 1-3), ``offload_param`` (``"cpu"`` and ``"nvme"``, stage 3) and ``memory_budget``
(``zeropp.engine.placement``: it places the optimizer states by size; the parameter shards stay where
``offload_param`` puts them and count against that tier's budget, NVMe-offloaded ones as if in host memory).**

* ``zero_optimization.offload_optimizer`` (stages 1, 2, 3): the optimizer states (fp32 master weights, moments,
  fp32 gradient shard) live on ``device`` and the optimizer step runs on the CPU. ``device``: ``"none"`` (default:
  off), ``"cpu"``, or ``"nvme"`` (any stage; DeepSpeed documents stage 3 only; masters and moments in swap files);
  ``nvme_path`` (required with ``"nvme"``): the swap directory, on a local NVMe drive; ``pin_memory`` (true:
  page-locked host buffers for full-bandwidth asynchronous copies; DeepSpeed's default since 0.19.5, false before);
  ``buffer_count`` (4, at least 1): NVMe: how many units' states are in memory at once (and the swap's host
  buffers); ``pipeline_read`` / ``pipeline_write`` (false): overlap the NVMe read of the next units / write of the
  previous ones with the step of the current one (false: each waited for at once); ``fast_init`` (false): DeepSpeed's
  switch between writing the initial NVMe master weights in batches or one by one; zeropp always writes them unit
  by unit as each unit is built, so it is checked and has no effect; ``ratio`` (1, a fraction above 0 and at
  most 1): the part of the optimizer states (and step) on the CPU, the rest staying on the accelerator (below 1:
  stage 3 and ``"cpu"`` only). ``super_offload`` is accepted as false only; ``cpuadam_cores_perc`` (a fraction in [0, 1]) sizes
  SuperOffload's CPU Adam and is checked and has no effect.
* ``zero_optimization.offload_param`` (stage 3 only, DeepSpeed's rule; an error at stages 1 and 2): the 16-bit
  parameter shards live on ``device`` between uses. ``device`` and ``nvme_path`` as above; ``pin_memory`` (true);
  ``buffer_count`` (5) and ``buffer_size`` (1e8 elements), both at least 1: the buffer pool NVMe reads and writes go
  through, and ``buffer_count`` also bounds the swapped shards in memory at once (DeepSpeed cannot swap a parameter
  larger than a buffer; zeropp moves such a shard in chunks of the buffer); ``max_in_cpu`` (1e9 elements, at least
  0): with NVMe, that many shard elements per rank (the first units' shards, in order) stay in CPU memory, the rest
  go to NVMe; the default keeps a model of fewer than 1e9 elements per rank wholly in CPU memory, as DeepSpeed.
  Every key of both blocks is validated whatever the device; with ``device: "none"`` the others have no effect.
* ``aio`` (top level; inside ``zero_optimization`` it is an error, as in DeepSpeed): the Linux asynchronous I/O of
  the NVMe tier. ``block_size`` (1048576 bytes per request), ``queue_depth`` (8 requests in flight),
  ``intra_op_parallelism`` (1 thread per read or write; DeepSpeed's name before 0.16.4, ``thread_count``, is read
  too: give only one), all at least 1; ``single_submit`` (false: requests are submitted as a batch);
  ``overlap_events`` (true: new requests go out without waiting for earlier ones); ``use_gds`` accepted as false only
  (GPUDirect Storage is not supported).
* ``zero_optimization.zeropp.memory_budget`` (zeropp's own; default null: none): ``{"device": bytes, "cpu":
  bytes}``, the most ZeRO-state bytes per rank on the accelerator and in CPU memory (integers at least 1; ``40e9``
  is read as 40000000000). Either may be left out: that tier's budget is then what the engine measures free there
  during the first step. Meaning: from the sizes the first step measured, the engine places each unit's states on
  the accelerator up to the device budget, then in CPU memory up to the CPU budget, then on NVMe, which has no
  budget (a ``"nvme"`` key is an error) and takes the rest. **With a budget, an offload block's ``device`` is the
  farthest tier that kind of state may go to, not where all of it goes**: ``"none"`` keeps it on the accelerator,
  ``"cpu"`` allows accelerator and CPU, ``"nvme"`` allows all three (its ``nvme_path`` is where NVMe states of that
  kind go). So a budget needs at least one block with a device other than ``"none"`` and cannot be combined with
  ``offload_optimizer.ratio`` below 1 (both would split the optimizer states); states that fit in no allowed tier
  are an error at the first step, never a silent spill. Without a budget the blocks mean what they mean in
  DeepSpeed: all of that kind of state on ``device``. The engine (``zeropp.engine.placement``) runs the first step
  with every unit's optimizer states in the farthest tier allowed, then moves them nearer (exactly: no value
  changes), prints what it chose on the first rank and keeps it in ``engine.placement``. A budget counts the
  optimizer states placed in that tier, the NVMe units' host memory (gradient shards, ``buffer_count`` units being
  stepped, the swap buffers) in ``cpu``, and the stage-3 parameter shards, which are not placed by size in this
  build: they stay where ``offload_param`` puts them (on the accelerator, or with ``"cpu"`` in CPU memory). On a
  machine without an accelerator the compute device is the CPU, so ``device`` and ``cpu`` bound one memory: the
  smaller of the two given applies to all of it.

Our own keys live in ``zero_optimization.zeropp`` (all optional):

* ``weight_bits`` (8 or 4, default 8): code width of the qwZ weight all-gather when ``zero_quantized_weights``;
* ``gradient_bits`` (8 or 4, default 4): code width of the qgZ reduce-scatter when ``zero_quantized_gradients``;
* ``block_size`` (a power of two from 16 to 8192, default 128): elements per quantization block;
* ``error_feedback`` (default false): keep each gradient buffer's qgZ quantization residual and add it back at
  the next reduction (``zeropp.comm.ErrorFeedback``); needs ``zero_quantized_gradients``;
* ``nonfinite_gradients`` (``"skip"`` or ``"raise"``, default ``"skip"``): in fp32 and bf16, what an optimizer
  step does when some rank's accumulated gradient holds an Inf or NaN (exact or qgZ, any stage). ``"skip"``:
  the step is skipped on every rank as an fp16 overflow is (nothing changes; ``skipped_steps`` counts it) and
  the first rank warns, naming the units; ``"raise"``: every rank raises ``zeropp.engine.NonFiniteGradientError``
  naming them. Under fp16 an Inf/NaN is a loss-scale overflow, handled by the loss scaler whatever this says
  (``zeropp.engine.engine`` has the details and the cost: one small all-reduce and one host read per step).
* ``entry_check_timeout`` (seconds, a number above 0 and at most 1e6, default 300): how long a rank that enters
  one of the engine's calls that every rank must make — ``model.state_dict()`` at stage 3 (outside a
  ``gathered_parameters`` block holding the units), ``engine.gathered_parameters()``, ``consolidated_state_dict()``,
  ``state_dict()``, ``full_parameters()``, ``save_16bit_model()``, ``load_state_dict()``, ``save_checkpoint()``,
  ``load_checkpoint()`` — waits for the others before raising ``zeropp.engine.EngineUsageError`` naming the ranks
  that did not come (a save from one rank, ``if rank == 0: model.save_pretrained(d)``, would otherwise wait for the
  process group's timeout, 30 minutes on gloo, with no message) and the pattern to use instead
  (``zeropp.engine.entry_check``). Long enough for a rank that evaluates or writes a large file alone before the
  call; short against torch's timeouts (30 minutes for gloo, 10 for NCCL). Nothing in the training loop waits on it.

DeepSpeed keys accepted as harmless (decided one by one):

* describing what zeropp does, accepted with that value only: ``prescale_gradients: false``,
  ``gradient_predivide_factor: 1.0``, ``memory_breakdown: false``, ``dump_state: false``, ``sparse_gradients:
  false``, ``fp32_allreduce: false`` (for an fp32 reduction set ``communication_data_type``), ``fp16.auto_cast:
  false``, ``fp16.consecutive_hysteresis: false``, ``fp16.fp16_master_weights_and_grads: false``, and in
  ``zero_optimization``: ``ignore_unused_parameters: true``, ``load_from_fp32_weights: true``,
  ``elastic_checkpoint``, ``legacy_stage1``, ``use_all_reduce_for_fetch_params``, ``pipeline_loading_checkpoint``:
  all ``false``; DeepSpeed's deprecated ``cpu_offload``, ``cpu_offload_params``, ``cpu_offload_use_pin_memory``:
  ``false`` (use the offload blocks);
* how DeepSpeed implements what zeropp computes its own way, any boolean, no effect on the result:
  ``contiguous_gradients``, ``allgather_partitions``, ``reduce_scatter`` (false: DeepSpeed all-reduces; zeropp
  always reduce-scatters, the same average), ``round_robin_gradients``, ``memory_efficient_linear``,
  ``log_trace_cache_warnings``; ``zero_allow_untested_optimizer`` (only the optimizers above exist);
* ``bf16.immediate_grad_update``: stages 2 and 3 always reduce each micro-batch's gradient into the fp32 shard
  (the immediate update), so any value is accepted there; stage 1 accumulates in the bf16 ``.grad`` (DeepSpeed's
  ZeRO-1), so true is an error at stage 1;
* feature blocks zeropp does not have, accepted while ``enabled`` is false (or absent): ``amp``, ``torch_autocast``,
  ``flops_profiler``, ``tensorboard``, ``wandb``, ``csv_monitor``, ``comms_logger``, ``hybrid_engine``,
  ``elasticity``, ``autotuning``, ``data_efficiency``, ``curriculum_learning``.

fp16 bounds: ``initial_scale_power`` in [0, 126] and a static ``loss_scale`` in [2**-126, 2**126] (the scale and
its reciprocal are then normal float32 numbers); with a dynamic scale, ``min_loss_scale`` at most
``2**initial_scale_power``. A JSON file that repeats a key in one object, at any depth, is an error naming it
(plain JSON readers keep the last value silently).

Errors (``ConfigError``, a ``ValueError``) are raised here, never mid-run, and list every problem of the config at
once, one line each naming the key and what to change. An unknown key gets the closest valid spelling and the valid
keys at its level. A DeepSpeed key that zeropp does not implement (pipeline, activation checkpointing,
``zero_quantized_nontrainable_weights``, MiCS, ...) says so. ``"auto"`` values (placeholders the Hugging Face
Trainer fills in) give one line naming every ``"auto"`` key.

One file per responsibility: ``errors`` (``ConfigError``, the problem collector), ``readers`` (reading one value
or block), ``blocks`` (``bf16``, ``fp16``, ``zero_optimization``), ``offload`` (``offload_optimizer``,
``offload_param``, ``aio``, ``memory_budget``), ``optimizer``, ``scheduler``, ``batch`` (the batch-size arithmetic),
``training`` (``Config``, the top-level keys), ``load`` (``load_config``, ``to_dict``).
"""

from .blocks import (
    NONFINITE_GRADIENTS,
    BF16Config,
    FP16Config,
    ZeroConfig,
    ZeroppConfig,
)
from .errors import ConfigError, Problems
from .load import load_config, to_dict
from .offload import (
    MEMORY_TIERS,
    OFFLOAD_DEVICES,
    AioConfig,
    MemoryBudget,
    OffloadOptimizerConfig,
    OffloadParamConfig,
)
from .optimizer import OptimizerConfig
from .scheduler import SCHEDULER_TYPES, SchedulerConfig
from .training import COMMUNICATION_DTYPES, Config

__all__ = [
    "COMMUNICATION_DTYPES",
    "MEMORY_TIERS",
    "NONFINITE_GRADIENTS",
    "OFFLOAD_DEVICES",
    "SCHEDULER_TYPES",
    "AioConfig",
    "BF16Config",
    "Config",
    "ConfigError",
    "FP16Config",
    "MemoryBudget",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OptimizerConfig",
    "Problems",
    "SchedulerConfig",
    "ZeroConfig",
    "ZeroppConfig",
    "load_config",
    "to_dict",
]
