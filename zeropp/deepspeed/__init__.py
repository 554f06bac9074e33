"""DeepSpeed's own ZeRO-3 engine running zeropp's ZeRO++ (qwZ, hpZ, qgZ): one line, no op to build.

    import zeropp.deepspeed
    zeropp.deepspeed.install()          # before deepspeed.initialize / deepspeed.zero.Init, on every rank
    engine, *_ = deepspeed.initialize(model=model, config={..., "zero_optimization": {"stage": 3,
        "zero_quantized_weights": True, "zero_hpz_partition_size": 8, "zero_quantized_gradients": True}})

Why: DeepSpeed's ZeRO++ needs a quantizer op JIT-built with nvcc and has defects of its own (bf16 through fp16,
sizes multiple of 8, blocks straddling parameters, hpZ quantized twice, qgZ off on one node). ``install()``
replaces DeepSpeed's quantized collectives by ``zeropp.comm``'s and its quantizer op by a torch one
(``ds_format``), pinned to the DeepSpeed versions in ``SUPPORTED_VERSIONS``; ``uninstall()`` puts DeepSpeed's
functions back. The design, each defect fixed and remaining, and what is tested: docs/deepspeed.md.

Files: ``versions.py`` (supported versions, the checks), ``patches.py`` (the patch table, ``install`` /
``uninstall``), ``all_gather.py`` (qwZ), ``hpz.py`` (hpZ's groups), ``reduce_scatter.py`` (qgZ), ``avg_scatter.py``
(qgZ on one node), ``ds_format.py`` (DeepSpeed's quantizer op in torch: the spec), ``quantizer.py`` (the
``CUDAQuantizer`` stand-in), ``stored_gather.py`` (frozen weights stored quantized), ``topology.py``.
"""

from .patches import install, installed, uninstall
from .versions import SUPPORTED_VERSIONS, UnsupportedDeepSpeedVersion

__all__ = ["SUPPORTED_VERSIONS", "UnsupportedDeepSpeedVersion", "install", "installed", "uninstall"]
