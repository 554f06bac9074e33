"""Optimizer steps for zeropp's float32 master shards: ``zeropp.optim.native.adam_step``, a fused Adam / AdamW step
on the CPU, bit for bit torch's fused step, with the compute-dtype copy of the parameters in the same pass. This
package knows nothing of torch.distributed.
"""
