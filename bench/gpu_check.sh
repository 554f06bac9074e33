#!/usr/bin/env bash
# The GPU check in stages, each one command well under the lent machines' 10-minute limit, from the repo root:
#
#   bash bench/gpu_check.sh STAGE [OUTDIR]      STAGE: kernels | tests | engine | all    (OUTDIR: $OUT or bench/gpu_out)
#
# kernels  bench/kernels.py with --check (every op on CUDA against the CPU reference bit for bit, plus one pack past
#          2^31 elements) at fp16 and bf16, blocks 128 and 2048, sizes 2^26 and 2^28 (2^24 is launch-bound and fits in
#          L2), timed with triton.testing.do_bench beside a copy of the same bytes; then a tile/warps sweep at 2^26.
#          About 4-6 minutes on an H100: 4 configurations x ~20 rows x (25 ms warm-up + 100 ms timing) x 2 (kernel and
#          copy) is ~20 s each, plus Triton's compilations (~50 specializations, 1-3 s each) and the CPU reference of
#          the checks (2^22 elements, ~10 ops, a few seconds each configuration).
# tests    the quant tests on CUDA (split over 4 pytest processes) and the comm tests (their CUDA test runs 4 gloo
#          ranks on this one GPU against the CPU reference), the engine's host-sync test. About 5 minutes.
# engine   bench/engine_device.py: world size 1 on NCCL (step-time overhead against plain torch training) and 4 gloo
#          ranks on CUDA tensors as 2 emulated nodes (exact ZeRO-3 and full ZeRO++), bf16. About 3 minutes.
#
# Each stage writes its logs and CSVs under OUTDIR/STAGE/, packs them into OUTDIR/STAGE.tar.gz (one file to bring
# back) and prints its summary last. Uses the machine's own torch and triton (nothing is installed: the GPU
# machines reach no package index); zeropp is imported from this checkout.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
stage=${1:?usage: bash bench/gpu_check.sh kernels|tests|engine|all [OUTDIR]}
out=${2:-${OUT:-bench/gpu_out}}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
summary=()
status=0

step() {  # step LOGNAME COMMAND...: run, tee the log, record pass/fail, go on
    local name=$1
    shift
    echo "=== $name: $*"
    "$@" 2>&1 | tee "$dir/$name.log"
    local rc=${PIPESTATUS[0]}
    if [ "$rc" = 0 ]; then summary+=("PASS $name"); else summary+=("FAIL $name (exit $rc)"); fi
}

finish() {  # pack the stage's folder, print the summary last
    tar -czf "$out/$stage_name.tar.gz" -C "$out" "$stage_name"
    echo
    echo "=== summary of stage $stage_name ($(cat "$dir/machine.txt" | tr '\n' ' '))"
    printf '%s\n' "${summary[@]}"
    grep -h "floor/time\|^| " "$dir"/kernels_*.log 2>/dev/null | grep -E "reduce_requantize int4 d=8|quantize int4 " | head -8
    echo "=== packed: $out/$stage_name.tar.gz"
    if printf '%s\n' "${summary[@]}" | grep -q '^FAIL'; then status=1; fi
}

begin() {  # begin STAGE: the folder and the machine's description
    stage_name=$1
    dir="$out/$stage_name"
    mkdir -p "$dir"
    summary=()
    { nvidia-smi -L; "$py" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } \
        > "$dir/machine.txt" 2>&1
}

stage_kernels() {
    begin kernels
    for dtype in fp16 bf16; do
        for block in 128 2048; do
            step "kernels_${dtype}_b$block" "$py" bench/kernels.py --sizes 2^26 2^28 --dtype "$dtype" --block-size "$block" \
                --check --csv "$dir/kernels_${dtype}_b$block.csv"
        done
    done
    step sweep_fp16_b128 "$py" bench/kernels.py --sizes 2^26 --sweep --no-deepspeed --csv "$dir/sweep_fp16_b128.csv"
    finish
}

stage_tests() {
    begin tests
    local pids=() files=(tests/quant/test_triton_kernels.py tests/quant/test_exact_arith.py tests/quant/test_format.py
                         tests/quant/test_reference_speed_invariants.py)
    for f in "${files[@]}"; do
        "$py" -m pytest -q -p no:cacheprovider -rs "$f" > "$dir/$(basename "$f" .py).log" 2>&1 &
        pids+=($!)
    done
    for i in "${!pids[@]}"; do
        wait "${pids[$i]}"
        local rc=$? name
        name=$(basename "${files[$i]}" .py)
        tail -3 "$dir/$name.log"
        if [ "$rc" = 0 ]; then summary+=("PASS $name"); else summary+=("FAIL $name (exit $rc)"); fi
    done
    step tests_comm "$py" -m pytest -q -p no:cacheprovider -rs tests/comm
    step host_syncs "$py" -m pytest -q -p no:cacheprovider -rs tests/engine/test_host_syncs.py
    finish
}

stage_engine() {
    begin engine
    step engine_nccl "$py" -m torch.distributed.run --standalone --nproc-per-node 1 bench/engine_device.py \
        --device cuda --backend nccl --preset small --steps 30 --dtype bf16
    ZEROPP_RANKS_PER_NODE=2 step engine_gloo_cuda "$py" -m torch.distributed.run --standalone --nproc-per-node 4 \
        bench/engine_device.py --device cuda --backend gloo --preset small --steps 20 --dtype bf16
    finish
}

case "$stage" in
    kernels) stage_kernels ;;
    tests) stage_tests ;;
    engine) stage_engine ;;
    all) stage_kernels; stage_tests; stage_engine ;;
    *) echo "unknown stage '$stage': use kernels, tests, engine or all" >&2; exit 2 ;;
esac
exit $status
