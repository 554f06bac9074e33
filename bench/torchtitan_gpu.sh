#!/usr/bin/env bash
# torchtitan's own Trainer (torchtitan.train) with zeropp.torchtitan, on GPUs (it cannot run on CPU: see
# zeropp/torchtitan.py). From the repository root:
#
#   bash bench/torchtitan_gpu.sh [OUTDIR]                          one GPU (a lent machine)
#   NGPU=8 ZEROPP_RANKS_PER_NODE=4 bash bench/torchtitan_gpu.sh    one 8-GPU node as 2 emulated nodes of 4
#
# Three torchrun jobs of torchtitan's llama3 debugmodel (6 layers, dim 256, vocab 2048; seq 2048, batch 8 per rank)
# for STEPS steps (default 30) from one seed on the same synthetic batches (bench/torchtitan_configs.py: no dataset
# or tokenizer files needed): torchtitan alone (baseline), zeropp's exact comms, int8 weights / int4 gradients;
# then bench/torchtitan_configs.py's summary (last loss, largest loss difference from the baseline, median
# tokens/s, zeropp's bytes) and its checks (exit status 1 when one fails). Logs and summary.csv go to OUTDIR
# (default $OUT, else bench/torchtitan_out). Each job runs under `timeout` (RUN_TIMEOUT seconds, default 170), so
# the script ends within about 9 minutes on a machine whose commands stop at 600 s.
#
# What one GPU proves: torchtitan's real Trainer on CUDA takes configure's config through its command line,
# calls the hook inside Trainer.__init__, zeropp.fsdp.enable accepts torchtitan's FSDP2 modules on its CUDA mesh,
# and training runs eager with the baseline's losses. It does NOT run zeropp's collectives: FSDP2 skips its
# all-gather and reduce-scatter over a one-rank mesh, so zeropp.comm.stats() stays 0 and the three runs' losses
# are equal (tests/fsdp/test_fsdp_cuda.py runs zeropp.fsdp's comms on one GPU, with gloo ranks).
# What 8 GPUs prove: the same with zeropp's comms on NCCL: exact = baseline at the printed precision, int8/int4
# within 2% per step, fewer bytes, and the tokens/s of each. ZEROPP_RANKS_PER_NODE=4 makes zeropp treat the node as
# 2 nodes of 4 (qgZ's cross-node hop runs, bytes are counted as inter-node); unset, the node is one node.
#
# Needs torchtitan importable by PYTHON (default python3; torchtitan 0.3 needs Python >= 3.11): pip install
# 'zeropp[torchtitan]'. A machine without a package index needs the wheels carried: on a machine with one,
#   pip download --no-deps -d wheels torchtitan==0.3.0 tyro==1.0.17 docstring_parser typeguard spmd_types==0.2.3 \
#     torchdata==0.11.0 torch_checkpointing==0.1.1 tensorboard==2.21.0 tensorboard-data-server==0.7.2 absl-py \
#     markdown protobuf grpcio datasets==4.7.0 dill==0.4.0 multiprocess==0.70.18 xxhash pandas pyarrow httpx httpcore
# (what `import torchtitan.train` needs beside torch, numpy, huggingface_hub, fsspec, pyyaml, requests, tqdm; 87 MB
# for CPython 3.11, 55 MB of it pyarrow), then there: pip install --no-index --no-deps wheels/*.whl
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

out=${1:-${OUT:-bench/torchtitan_out}}
py=${PYTHON:-python3}
steps=${STEPS:-30}
mkdir -p "$out"
export PYTHONPATH="$PWD/bench:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if ! "$py" -c 'import torchtitan.train' 2>"$out/import.log"; then
    tail -n 5 "$out/import.log" >&2
    echo "torchtitan.train does not import with $py (above); install torchtitan (see this script's header)" >&2
    exit 2
fi
NGPU=${NGPU:-$("$py" -c 'import torch; print(torch.cuda.device_count())')}
export NGPU
if [ "$NGPU" -lt 1 ]; then
    echo "no CUDA device visible to $py: torchtitan's Trainer needs one per rank" >&2
    exit 2
fi
echo "torchtitan $("$py" -c 'import torchtitan; print(torchtitan.__version__)'), torch" \
    "$("$py" -c 'import torch; print(torch.__version__, torch.cuda.get_device_name())'), $NGPU GPU(s), $steps steps," \
    "ZEROPP_RANKS_PER_NODE=${ZEROPP_RANKS_PER_NODE:-unset}"

for config in baseline zeropp_exact zeropp; do
    echo "== $config"
    timeout "${RUN_TIMEOUT:-170}" "$py" -m torch.distributed.run --standalone --nproc_per_node="$NGPU" \
        --local-ranks-filter 0 --role rank --tee 3 \
        -m torchtitan.train --module torchtitan_configs --config "llama3_debugmodel_$config" \
        --training.steps "$steps" >"$out/$config.log" 2>&1
    echo "exit status $? (log: $out/$config.log)"
done
"$py" bench/torchtitan_configs.py "$out"
