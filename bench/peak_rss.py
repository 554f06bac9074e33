"""Peak RSS per rank (``resource.getrusage`` ``ru_maxrss``) of stage-3 training of the small GPT, under torchrun:

    ZEROPP_RANKS_PER_NODE=2 OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 4 \\
        bench/peak_rss.py zeropp fp32 30 '{"stage3_max_reuse_distance": 0, "stage3_param_persistence_threshold": 0}'

Arguments: config (``zero3``, ``zeropp`` = qwZ + hpZ + qgZ, or a JSON dict of ``zero_optimization`` keys), dtype
(fp32, bf16), steps, extra ``zero_optimization`` keys (JSON). Rank 0 prints every rank's peak RSS every 3 steps.
RSS is unaffected by other jobs on the machine (timings are not).
"""

import json
import os
import resource
import sys

import torch
import torch.distributed as dist

import zeropp
from zeropp import comm
from zeropp.data import TextBatches, stdlib_corpus
from zeropp.models.gpt import GPT, GPTConfig

name, dtype = sys.argv[1], sys.argv[2]
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 10
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
rpn = int(os.environ.get("ZEROPP_RANKS_PER_NODE", "2"))
topo = comm.Topology(ranks_per_node=rpn, hpz_partition_sizes=(rpn,))
zero = {"stage": 3}
if name == "zeropp":
    zero.update(zero_quantized_weights=True, zero_hpz_partition_size=rpn, zero_quantized_gradients=True)
elif name != "zero3":
    zero.update(json.loads(name))
zero.update(json.loads(sys.argv[4]) if len(sys.argv) > 4 else {})
cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0, "zero_optimization": zero,
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "bf16": {"enabled": dtype == "bf16"}}
engine, _, _, _ = zeropp.initialize(model=GPT(GPTConfig.preset("small", block_size=32), seed=0), config=cfg,
                                    topology=topo)
data = TextBatches(stdlib_corpus(), seq_len=32, global_batch=world, seed=0)
peaks = []
for step in range(steps):
    x, y = data.micro_batch(step, rank=rank, world_size=world)
    _, loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    peaks.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)  # KiB on Linux
out = [None] * world
dist.all_gather_object(out, peaks)
if rank == 0:
    for r, p in enumerate(out):
        print(f"{name} {dtype} rank{r}: peak RSS every 3 steps {[round(x / 1e3) for x in p[::3]]} MB, "
              f"final {p[-1] / 1e3:.0f} MB")
dist.destroy_process_group()
