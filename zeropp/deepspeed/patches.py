"""``install()`` / ``uninstall()``: the table of DeepSpeed attributes zeropp replaces, and putting them back.

Each entry is (owner, attribute name, replacement); ``install`` saves the owner's current value and sets the
replacement, ``uninstall`` restores the saved values in reverse order. The owners are DeepSpeed's modules and
classes as of the versions in ``versions.SUPPORTED_VERSIONS``:

* ``deepspeed.runtime.zero.partition_parameters.CUDAQuantizer`` and stage 3's binding of it ->
  ``quantizer.CUDAQuantizer`` (DeepSpeed's wire format in torch, ``ds_format``: no op to build); the class
  attribute ``Init.quantizer_module`` (which DeepSpeed reads, never sets, for one-rank partitions) -> an instance
  of it; ``deepspeed.runtime.comm.coalesced_collectives.quantizer_module`` (its op, loaded on first use) ->
  ``ds_format``;
* ``Init._partition_param`` and ``Init._partition_param_sec`` -> ``stored_gather.partition_wrapper`` (frozen
  weights stored quantized from their values, not from uninitialised memory);
* ``deepspeed.runtime.zero.partition_parameters.Init._convert_to_deepspeed_param`` -> a wrapper that runs
  DeepSpeed's, makes the parameter group's ``Topology`` (``topology.topology_for``; the first parameter of each group) and, when the ``Init`` has
  ``zero_quantized_weights`` on, replaces ``param.all_gather_coalesced`` by ``all_gather.ParamGather``, and,
  with ``zero_quantized_nontrainable_weights`` on, wraps the result in ``stored_gather.StoredGather``;
* ``deepspeed.runtime.zero.stage3.all_to_all_quant_reduce`` (stage 3's binding, the one it calls) and
  ``deepspeed.runtime.comm.coalesced_collectives.all_to_all_quant_reduce`` (where it is defined) ->
  ``reduce_scatter.all_to_all_quant_reduce``;
* ``deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3.__avg_scatter_grads`` (name-mangled) ->
  ``avg_scatter.avg_scatter_grads`` (qgZ on one node too);
* ``deepspeed.utils.groups._create_zero_param_parallel_group`` -> ``hpz.create_zero_param_parallel_group`` (hpZ
  groups inside zeropp's nodes, whatever the rank numbering);
* ``deepspeed.runtime.engine.DeepSpeedEngine.destroy`` -> ``hpz.destroy_wrapper`` (DeepSpeed's, then the hpZ
  group forgotten: a later engine gets hpZ only from its own config).
"""

from __future__ import annotations

from typing import Any

from .versions import check_version, installed_version

_saved: list[tuple[Any, str, Any]] = []
_MISSING = object()


def installed() -> bool:
    """Whether ``install()`` is in effect."""
    return bool(_saved)


def install() -> None:
    """Make DeepSpeed's ZeRO-3 engines and ``zero.Init`` contexts created from now on run zeropp's ZeRO++.

    Call it on every rank before ``deepspeed.initialize`` (or ``deepspeed.zero.Init``); a second call does
    nothing. DeepSpeed picks its accelerator when first imported: set ``DS_ACCELERATOR`` (``cpu`` for CPU
    training) before importing it, or let this import it with its own choice.

    Raises:
        ImportError: DeepSpeed is not installed.
        UnsupportedDeepSpeedVersion: the installed DeepSpeed is not one of ``SUPPORTED_VERSIONS``.
    """
    if _saved:
        return
    check_version(installed_version())
    from deepspeed.runtime.comm import coalesced_collectives
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero import partition_parameters, stage3
    from deepspeed.utils import groups

    from . import ds_format
    from .avg_scatter import MANGLED_NAME, avg_scatter_grads
    from .hpz import create_zero_param_parallel_group, destroy_wrapper
    from .quantizer import CUDAQuantizer
    from .reduce_scatter import all_to_all_quant_reduce
    from .stored_gather import partition_wrapper

    init = partition_parameters.Init
    for owner, name, replacement in (
        (partition_parameters, "CUDAQuantizer", CUDAQuantizer),
        (stage3, "CUDAQuantizer", CUDAQuantizer),
        (init, "quantizer_module", CUDAQuantizer()),
        (coalesced_collectives, "quantizer_module", ds_format),
        (init, "_partition_param", partition_wrapper(init._partition_param, secondary=False)),
        (init, "_partition_param_sec", partition_wrapper(init._partition_param_sec, secondary=True)),
        (partition_parameters.Init, "_convert_to_deepspeed_param",
         _convert_wrapper(partition_parameters.Init._convert_to_deepspeed_param)),
        (stage3, "all_to_all_quant_reduce", all_to_all_quant_reduce),
        (coalesced_collectives, "all_to_all_quant_reduce", all_to_all_quant_reduce),
        (stage3.DeepSpeedZeroOptimizer_Stage3, MANGLED_NAME, avg_scatter_grads),
        (groups, "_create_zero_param_parallel_group", create_zero_param_parallel_group),
        (DeepSpeedEngine, "destroy", destroy_wrapper(DeepSpeedEngine.destroy)),
    ):
        _saved.append((owner, name, owner.__dict__.get(name, _MISSING)))
        setattr(owner, name, replacement)


def uninstall() -> None:
    """Put back every DeepSpeed attribute ``install()`` replaced (engines created afterwards run DeepSpeed's own
    ZeRO++); forget the topologies made while installed. Does nothing when not installed."""
    from .topology import forget

    while _saved:
        owner, name, original = _saved.pop()
        if original is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, original)
    forget()


def _convert_wrapper(original: Any) -> Any:
    from .all_gather import ParamGather
    from .stored_gather import StoredGather
    from .topology import topology_for

    def _convert_to_deepspeed_param(self: Any, param: Any) -> None:
        original(self, param)
        topology_for(param.ds_process_group)  # a collective point: qwZ and qgZ need the layout later
        if self.quantized_weights:
            param.all_gather_coalesced = ParamGather(self, param.all_gather_coalesced)
        if self.quantized_nontrainable_weights:
            param.all_gather_coalesced = StoredGather(self, param.all_gather_coalesced)

    _convert_to_deepspeed_param.__wrapped__ = original  # type: ignore[attr-defined]
    return _convert_to_deepspeed_param

