#!/usr/bin/env bash
# Everything a session with a lent GPU should run, in one call, from the repository root:
#
#   bash bench/gpu_check.sh [OUTDIR]        (OUTDIR defaults to $OUT, else bench/gpu_out)
#
# 1. the quant tests on CUDA tensors (Triton kernels against the torch reference, bit for bit on the codes);
# 2. the comm tests (gloo) and the kernel benchmark: every kernel against a copy of the same bytes, at the
#    DESIGN.md anchor size (2^28 fp16 elements) for the default block size and for 2048;
# 3. the collective benchmark at world size 1 on NCCL (a smoke test of the NCCL path: one GPU, one rank);
# 4. the engine on CUDA against plain torch training: world size 1 on NCCL (its step-time overhead) and 4 ranks
#    (2 emulated nodes of 2) with gloo on CUDA tensors, exact ZeRO-3 and full ZeRO++ (bench/engine_device.py).
# Logs and CSVs land in OUTDIR. Uses the machine's own torch and triton (nothing is installed: the GPU
# machines reach no package index); zeropp is imported from this checkout.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${1:-${OUT:-bench/gpu_out}}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
status=0
step() {  # step NAME COMMAND...: run, tee the log, remember a failure, go on
    local name=$1
    shift
    echo "=== $name: $*"
    "$@" 2>&1 | tee "$out/$name.log"
    local rc=${PIPESTATUS[0]}
    [ "$rc" = 0 ] || { echo "=== $name FAILED (exit $rc)"; status=1; }
}

nvidia-smi -L > "$out/machine.txt" 2>&1
"$py" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__,
torch.cuda.get_device_name(0))' >> "$out/machine.txt" 2>&1
cat "$out/machine.txt"

step tests_quant "$py" -m pytest -q tests/quant -p no:cacheprovider
step kernels "$py" bench/kernels.py --sizes 2^24 2^28 --csv "$out/kernels.csv"
step kernels_b2048 "$py" bench/kernels.py --sizes 2^28 --block-size 2048 --csv "$out/kernels_b2048.csv"
step tests_comm "$py" -m pytest -q tests/comm -p no:cacheprovider
step collectives_nccl "$py" -m torch.distributed.run --standalone --nproc-per-node 1 -m zeropp.bench.collectives \
    --min-bytes 1M --max-bytes 256M --factor 4 --csv "$out/collectives_nccl.csv"
step engine_nccl "$py" -m torch.distributed.run --standalone --nproc-per-node 1 bench/engine_device.py \
    --device cuda --backend nccl --preset small --steps 30
ZEROPP_RANKS_PER_NODE=2 step engine_gloo_cuda "$py" -m torch.distributed.run --standalone --nproc-per-node 4 \
    bench/engine_device.py --device cuda --backend gloo --preset small --steps 20
exit $status
