"""``zeropp.zero``: DeepSpeed's ``deepspeed.zero`` namespace, so that ``import zeropp as deepspeed`` scripts run.

* ``Init``: build a model on the meta device; ``zeropp.initialize`` materialises it unit by unit
  (``zeropp.engine.materialize``);
* ``GatheredParameters(params, modifier_rank=None, fwd_module=None, enabled=True)``: whole parameters inside a
  block, the engine found from the parameters (``zeropp.engine.gathered``).
"""

from .engine.gathered import GatheredParameters
from .engine.materialize import Init

__all__ = ["GatheredParameters", "Init"]
