"""DeepSpeed's own ZeRO-3 engine running zeropp's ZeRO++ (qwZ, hpZ, qgZ): one line, no op to build.

    import zeropp.deepspeed
    zeropp.deepspeed.install()          # before deepspeed.initialize / deepspeed.zero.Init, on every rank
    engine, *_ = deepspeed.initialize(model=model, config={..., "zero_optimization": {"stage": 3,
        "zero_quantized_weights": True, "zero_hpz_partition_size": 8, "zero_quantized_gradients": True}})

``install()`` is idempotent; ``uninstall()`` puts DeepSpeed's functions back. Both act on engines (and
``zero.Init`` contexts) created afterwards: a parameter converted while installed keeps zeropp's gather, one
converted before keeps DeepSpeed's. Missing DeepSpeed raises ``ImportError``, a version not in
``SUPPORTED_VERSIONS`` raises ``UnsupportedDeepSpeedVersion`` naming the supported ones (checked from the
installed package's metadata, before DeepSpeed is imported).

Design (DeepSpeed 0.19.8; every name below is read from its source and pinned by version)
========================================================================================

Two ways in, preferred in this order:

1. **Collective entry points** (``patches.py``): where DeepSpeed calls a function that does a whole quantized
   collective, that function is replaced by one built on ``zeropp.comm``; the wire format is then zeropp's
   (``zeropp.quant.format``: one packed buffer per rank, blocks of ``DEFAULT_BLOCK_SIZE`` with a float32 scale,
   every float dtype natively), and DeepSpeed's quantizer op is never loaded.

   * qwZ — ``Init._convert_to_deepspeed_param`` is wrapped: after DeepSpeed's conversion, the parameter's
     ``all_gather_coalesced(params, safe_mode, quantize)`` closure is replaced by ``all_gather.ParamGather``.
     With ``quantize=True`` on a primary shard (the coordinator passes ``quantize=zero_quantized_weights``) it
     does DeepSpeed's bookkeeping (NVMe swap-in, ``INFLIGHT``, ``ds_id`` order, ``safe_mode`` checks) and then
     ONE ``zeropp.comm.all_gather(bits=8)`` per shard dtype: each parameter's shard starts at a block boundary of
     the rank's pack (zero padding to the block), so no block straddles two parameters, any size works
     (a vocab of 50257), bf16 and fp32 are dequantized straight into their own dtype, and codes and scales
     travel in one collective. Its handle (``all_gather.QuantizedGatherHandle``) sets ``param.data`` and
     ``AVAILABLE`` like DeepSpeed's ``AllGatherCoalescedHandle``. Weights stored quantized
     (``zero_quantized_nontrainable_weights``) go to ``stored_gather.StoredGather`` (below), everything else
     (``quantize=False``, one rank) to DeepSpeed's own closure.
   * hpZ — the backward gather of the secondary shard (``ds_secondary_tensor``, in DeepSpeed's
     ``zero_param_process_group``) goes to DeepSpeed's closure with ``quantize=False``: an exact in-node
     gather, so backward sees exactly the (dequantized) weights forward used; DeepSpeed quantizes it a second
     time. The secondary shards stay DeepSpeed's (``_partition_param_sec``); their group comes from
     ``hpz.create_zero_param_parallel_group`` (replacing ``groups._create_zero_param_parallel_group``): the
     partition of this rank's node in zeropp's ``Topology``, not a run of consecutive global ranks, and a size
     that does not divide the ranks per node is refused. ``DeepSpeedEngine.destroy`` is wrapped to forget the
     group (``hpz.destroy_wrapper``), so a later engine in the process gets hpZ only from its own config.
   * qgZ — ``stage3.all_to_all_quant_reduce(tensors, groups)`` (stage 3's binding, and the same name in
     ``runtime.comm.coalesced_collectives``) -> ``reduce_scatter.all_to_all_quant_reduce``: ONE
     ``zeropp.comm.reduce_scatter(bits=4, op=AVG)`` over a flat bucket of the tensors' slices, each padded to a
     block, returning rank r's slice of the mean in ``reduce_scatter_coalesced``'s layout.
     Stage 3's ``__avg_scatter_grads`` is replaced by ``avg_scatter.avg_scatter_grads``, DeepSpeed's method
     with its "more than one node" condition dropped, so qgZ also runs on one node.

2. **Kernel module** (``ds_format.py``, ``quantizer.py``, ``stored_gather.py``): where DeepSpeed itself calls its
   quantizer op, ``ds_format`` is that op in torch — its function names (``quantize``, ``dequantize``,
   ``dequantize_fp32``, ``swizzle_quant``, ``quantized_reduction``, ``Symmetric``) and its wire format (groups of
   ``numel / groups`` consecutive elements, int8/int4 symmetric codes ``round_half_even(x * s)`` with
   ``s = 2**(b-1) / absmax``, a float32 scale per group holding ``1 / s``), the spec in its docstring, any device and
   float dtype. ``partition_parameters.CUDAQuantizer`` (and stage 3's binding) -> ``quantizer.CUDAQuantizer`` on it
   (DeepSpeed's group search for the sizes it accepts, any size otherwise); ``Init.quantizer_module`` and
   ``coalesced_collectives.quantizer_module`` are set too. So ``zero_quantized_nontrainable_weights`` (frozen
   weights stored as int8 codes and scales) runs on any accelerator; ``stored_gather.py`` wraps DeepSpeed's
   storage of those weights and replaces its gather of them (DeepSpeed's coalesced wire format kept), both
   defective in 0.19.8 (below).

The node layout (byte accounting, qgZ's two hops) is a ``zeropp.comm.Topology`` of DeepSpeed's partition group
(``topology.py``), made once per group while DeepSpeed converts the parameters (every rank converts the same
parameters in the same order: a collective point); its ranks per node come from ``$ZEROPP_RANKS_PER_NODE``, else
``$LOCAL_WORLD_SIZE``, else the host names.

DeepSpeed defects (see /work/shared/DESIGN.md §2 and its issues #3992 #4852 #7775 #3864 #4309 #4386 #5054 #6795
#8626)
----------------------------------------------------------------------------------------------------------------
Fixed with ``install()`` (qwZ, hpZ):

* the quantizer op must be JIT-built with nvcc (fails on CPU, ROCm, NPU): nothing is built; CUDA runs Triton,
  CPU the native library, anything else the torch reference (``zeropp.quant``);
* bf16 weights go through fp16 in DeepSpeed's quantizer (range clipped at 65504): quantized and dequantized in
  their own dtype here (qwZ, and frozen weights stored quantized);
* sizes must be multiples of 8 (``CUDAQuantizer.quantize`` asserts ``numel % (8 * groups) == 0``): any size;
* blocks straddle parameters (a bucket is quantized as one vector, a LayerNorm bias shares a scale with a large
  weight), and awkward sizes degrade to tiny groups: blocks are per parameter, of a fixed size;
* codes and scales move in two collectives, dequantized into a temporary then concatenated: one collective;
* hpZ's in-node backward gather is quantized a second time: exact;
* hpZ groups are runs of consecutive global ranks (across nodes when a launcher deals ranks round-robin over
  machines): made from zeropp's node layout;
* ``engine.destroy()`` keeps the hpZ group in a module global (``groups._ZERO_PARAM_INTRA_PARALLEL_GROUP``), so a
  later stage-3 engine in the process gets hpZ whatever its config says: forgotten at ``destroy()``.

Fixed with ``install()`` (qgZ): on one node qgZ runs (DeepSpeed silently reduces exactly: ``num_nodes = world //
accelerator.device_count()`` must exceed 1); the mean, not sum / nodes (``ranks per node`` times the mean, by our
reading of DeepSpeed's kernels); bf16 and fp32 natively (no fp16 cast); 1-D tensors and sizes not divisible by ``2 *
world`` quantized too (DeepSpeed falls back to an exact reduce-scatter); one collective per bucket, blocks per
tensor, instead of a Python loop of four all-to-alls per tensor.

Fixed with ``install()`` (``zero_quantized_nontrainable_weights``): it runs without the op; frozen weights are
stored from their values (DeepSpeed stores garbage: the codes of ``torch.empty``, overwritten by the float weights
cast to int8); a bucket of them is dequantized with each weight's own groups into its own dtype (DeepSpeed: one
group size for all, the result cast to int8; a padded weight's groups misplaced); any size, bf16 natively; scales
flat, so DeepSpeed's ``zero.GatheredParameters`` gathers them on gloo too.

Fixed with ``install()`` (hpZ's groups, ``hpz.py``): each group is a node's ranks in zeropp's node layout, also
when a launcher numbers ranks round-robin across machines (DeepSpeed: runs of consecutive global ranks); a size
not dividing the ranks per node is refused; ``engine.destroy()`` clears DeepSpeed's module global
(``groups._ZERO_PARAM_INTRA_PARALLEL_GROUP``), so a later stage-3 engine without hpZ no longer inherits it.

Remaining (DeepSpeed's code around the entry points, unchanged): hpZ groups are cut from the world's nodes, not
the data-parallel group's (as DeepSpeed's are from the world's ranks); an engine that is never destroyed still
hands its hpZ group to the next stage-3 engine of the process (destroy it first: ``accelerator.free_memory()``
does, for the Trainer); qgZ reduces over the world (refused, not wrong, when DeepSpeed's data-parallel group is
smaller). Frozen weights stored quantized keep DeepSpeed's format: groups of up to 8000 elements with step
``absmax / 128`` (a LayerNorm weight of ones comes back as 127/128), two collectives per bucket; a weight
frozen after the engine is made needs DeepSpeed's ``quantize_nontrainable_params`` (unchanged: fp16 only).

Status and next steps
---------------------
Tested (tests/deepspeed, one launch of 4 gloo ranks as 2 emulated nodes, DeepSpeed's CPU accelerator, a GPT with no
parameter size a multiple of 8, on the stdlib sources as text): at step 0 qwZ's gathered weights are within the
block bound of the exact ones (fp32, bf16, vocab 251 and 50257), hpZ's forward is exact and qgZ's gradient norm
within 3% of DeepSpeed's exact ZeRO-3 (measured 0.2-1.3%); over 100 fp32 steps the 10-step loss means stay within
6% of exact ZeRO-3 (measured at most 3.2%); qgZ runs on one node; ``all_to_all_quant_reduce`` is the mean (within
its int4 bound of ``all_reduce / world``, slope 1); hpZ through DeepSpeed's ``save_checkpoint`` /
``load_checkpoint`` resumes bit for bit; zeropp's counted cross-node bytes equal the formulas and the bytes it
hands torch.distributed, DeepSpeed's exact reduce-scatter sends the formula's bytes and with zeropp everything
crossing nodes is 0.175x exact ZeRO-3's over 100 steps (tests/deepspeed/wire.py counts both libraries' calls);
install is idempotent and uninstall restores DeepSpeed's attributes; missing and unsupported DeepSpeed raise named
errors; hpZ's groups are the nodes also when the nodes hold ranks {0, 2} and {1, 3} (DeepSpeed's own gathers then
send nothing across nodes), ``destroy()`` clears the group (a following engine without hpZ gets none) and a size
not dividing the ranks per node is refused; tests/hf runs ``transformers.Trainer`` with qwZ + hpZ + qgZ on 4 ranks
as 2 nodes (24 steps, resume); with ``zero_quantized_nontrainable_weights`` and 13 parameters frozen, the frozen
weights DeepSpeed gathers (in training and through ``zero.GatheredParameters``; alone and with qwZ + hpZ + qgZ;
fp32 and bf16) are within the int8 bound of the exact ones and the loss within 0.2% of exact ZeRO-3 over 3 steps
(measured 0.02%; 1% with qwZ + hpZ + qgZ, measured 0.5%). ``ds_format`` matches a float64 re-derivation of its
spec bit for bit (tests/deepspeed/test_ds_format.py) and its group search DeepSpeed's;
tests/deepspeed/test_quantizer_cuda.py compares it with DeepSpeed's CUDA op (not yet run: no GPU here). Next: that
GPU run, CUDA streams checked on a GPU.

Files: ``versions.py`` (supported versions, the checks), ``patches.py`` (the patch table, ``install`` /
``uninstall``), ``all_gather.py`` (qwZ), ``hpz.py`` (hpZ's groups), ``reduce_scatter.py`` (qgZ), ``avg_scatter.py``
(qgZ on one node), ``ds_format.py`` (DeepSpeed's quantizer op in torch: the spec), ``quantizer.py`` (the
``CUDAQuantizer`` stand-in), ``stored_gather.py`` (frozen weights stored quantized), ``topology.py``.
"""

from .patches import install, installed, uninstall
from .versions import SUPPORTED_VERSIONS, UnsupportedDeepSpeedVersion

__all__ = ["SUPPORTED_VERSIONS", "UnsupportedDeepSpeedVersion", "install", "installed", "uninstall"]
