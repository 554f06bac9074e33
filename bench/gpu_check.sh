#!/usr/bin/env bash
# The GPU check in stages, one command each, from the repository root:
#
#   bash bench/gpu_check.sh STAGE [OUTDIR] [--quick]     STAGE: kernels | tests | engine | all
#
# OUTDIR defaults to $OUT, else bench/gpu_out. A stage writes its logs and CSVs under OUTDIR/STAGE/, packs them into
# ONE archive OUTDIR/STAGE.tar.gz (the folder is removed once packed: the lent machines return at most 8 files) and
# prints its summary LAST (bench/gpu_summary.py: every step's status, then the key results); its exit status is 0
# when every step passed. Every step runs under `timeout` within the stage's budget (GPU_CHECK_BUDGET seconds,
# default 540: the lent machines stop a command at 600), so a stage always gets to pack and summarize; a step that
# is cut short shows TIMEOUT, one that had no time left SKIP. `all` runs the three stages one after the other,
# each with its own archive, for a machine without a time limit (budget 3600 s per stage).
#
# kernels  bench/kernels.py --check at 2^26 and 2^28 elements (2^24 is launch-bound and fits in L2), fp16 and bf16,
#          blocks 128 and 2048: every row bit for bit against the CPU reference on the inputs it is timed on, the
#          ops once per dtype on a tensor past 2^31 elements, timed with triton.testing.do_bench beside a copy of
#          the same bytes; the same for the CUDA C++ kernels (built here by CMake, run through CuPy: --backend
#          native); then the tile/warps sweep of the Triton main rows at 2^26 (fp16, block 128), checked too.
#          Measured on an H100 (Triton rows and sweep): 105 s + 79 s.
# tests    the native kernels built, then 10 pytest processes at once: test_kernels.py (the Triton, native CPU and
#          CUDA C++ kernels on this machine) in 4 shards through bench/pytest_shard.py (pytest-xdist is not
#          assumed), the other quant tests, the sm_90 compile tests (Triton with this machine's triton, the CUDA C++
#          with its nvcc), the comm tests (their CUDA test: 4 gloo ranks on this GPU against the CPU reference),
#          zeropp.fsdp's CUDA test (FSDP2 + zeropp, 4 gloo ranks on this GPU, against plain FSDP2 on CPU), the
#          engine's host-sync and offload tests, DeepSpeed's quantizer op against ours (limit 480 s each).
#          Measured on an H100: 206 s (2026-11-27; the comm tests are the longest).
# engine   bench/engine_device.py on CUDA in bf16: world size 1 on NCCL (overhead against plain training) and 4
#          gloo ranks on this GPU as 2 emulated nodes (exact ZeRO-3 and full ZeRO++); world size 1 in fp32; the
#          collective benchmark on NCCL at world size 1 (a smoke test). Estimate ~2-3 min.
# How the estimates were made (no GPU has run them yet): bench/RESULTS.md, "The GPU check in stages".
#
# --quick: the same steps on the CPU at toy sizes (torch backend, tiny model, a few tests), each stage in well
# under 30 s: what tests/bench/test_gpu_check.py runs, so the script works the first time it meets a GPU.
# Uses the machine's own torch and triton (the GPU machines reach no package index); zeropp is imported from this
# checkout. zeropp's dependencies the machine lacks travel as wheels on PYTHONPATH: crc32c (zeropp.offload, which the
# engine imports), and for the DeepSpeed test deepspeed with pydantic, pydantic_core, annotated_types,
# typing_inspection and hjson (the lent H100s had none of them on 2026-11-27; their image sets a TORCH_CUDA_ARCH_LIST
# DeepSpeed's JIT cannot parse, hence 9.0 below). PYTHON picks the interpreter (default python3); GPU_CHECK_DEEPSPEED=1 also times DeepSpeed's kernels.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

usage() { echo "usage: bash bench/gpu_check.sh kernels|tests|engine|all [OUTDIR] [--quick]"; }
stage="" out="" quick=0
for arg in "$@"; do
    case "$arg" in
        --quick) quick=1 ;;
        -h|--help) usage; exit 0 ;;
        -*) usage >&2; exit 2 ;;
        *) if [ -z "$stage" ]; then stage=$arg; elif [ -z "$out" ]; then out=$arg; else usage >&2; exit 2; fi ;;
    esac
done
out=${out:-${OUT:-bench/gpu_out}}
py=${PYTHON:-python3}
# the native kernels (kernels/): the CPU library and, where nvcc is, the CUDA fatbin
build=(bash -c 'cmake -S . -B build -DCMAKE_BUILD_TYPE=Release && cmake --build build -j "$(nproc)"')
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

case "$stage" in
    kernels|tests|engine) ;;
    all)
        rc=0
        for s in kernels tests engine; do
            GPU_CHECK_BUDGET=${GPU_CHECK_BUDGET:-3600} bash "$0" "$s" "$out" $([ $quick = 1 ] && echo --quick) || rc=1
        done
        exit $rc ;;
    *) usage >&2; exit 2 ;;
esac

budget=${GPU_CHECK_BUDGET:-540}
reserve=20  # seconds kept back for the summary and the archive
deadline=$((SECONDS + budget))
mkdir -p "$out"
work="$out/$stage"
rm -rf "$work" "$out/$stage.tar.gz"
mkdir -p "$work"
: > "$work/steps.tsv"

limit_for() {  # limit_for SECONDS: the step's limit cut to the time left (0: none left)
    local left=$((deadline - reserve - SECONDS))
    if [ "$left" -lt 5 ]; then echo 0; elif [ "$1" -gt "$left" ]; then echo "$left"; else echo "$1"; fi
}

record() {  # record NAME RC SECONDS LIMIT
    local status=PASS
    [ "$2" = 0 ] || status=FAIL
    { [ "$2" = 124 ] || [ "$2" = 137 ]; } && status=TIMEOUT
    printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$status" "$2" "$3" "$4" >> "$work/steps.tsv"
    echo "=== $1: $status (exit $2, $3 s of $4 s)"
}

skip() {  # skip NAME: no time left for the step
    printf '%s\tSKIP\t-\t0\t0\n' "$1" >> "$work/steps.tsv"
    echo "=== $1: SKIP (no time left)"
}

step() {  # step NAME LIMIT COMMAND...: run in the foreground under timeout, output to the terminal and NAME.log
    local name=$1 limit
    limit=$(limit_for "$2")
    shift 2
    if [ "$limit" = 0 ]; then skip "$name"; return; fi
    echo "=== $name (limit $limit s): $*"
    local t0=$SECONDS
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$work/$name.log"
    record "$name" "${PIPESTATUS[0]}" $((SECONDS - t0)) "$limit"
}

bg_step() {  # bg_step NAME LIMIT COMMAND...: the same in the background, output to NAME.log only (then: wait)
    local name=$1 limit
    limit=$(limit_for "$2")
    shift 2
    if [ "$limit" = 0 ]; then skip "$name"; return; fi
    echo "=== $name (limit $limit s, in the background): $*"
    (
        t0=$SECONDS
        timeout -k 10 "$limit" "$@" > "$work/$name.log" 2>&1
        record "$name" $? $((SECONDS - t0)) "$limit"
    ) &
}

machine() {
    {
        nvidia-smi -L 2>/dev/null || echo "no nvidia-smi (no GPU)"
        "$py" -c 'import platform, torch
try:
    import triton; t = triton.__version__
except ImportError:
    t = "none"
print("python", platform.python_version(), "torch", torch.__version__, "triton", t, "cuda",
      torch.version.cuda, "|", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device")' 2>&1
        local commit
        commit=$(git rev-parse --short HEAD 2>/dev/null || echo "no git")
        git status --porcelain 2>/dev/null | grep -q . && commit="$commit (modified)"
        echo "$(nproc) CPUs, commit $commit, $(date -u +%FT%TZ)"
    } > "$work/machine.txt" 2>&1
    cat "$work/machine.txt"
}

stage_kernels() {
    local ds=--no-deepspeed
    [ "${GPU_CHECK_DEEPSPEED:-0}" = 1 ] && ds=""
    if [ $quick = 1 ]; then
        step kernels_main 120 "$py" bench/kernels.py --device cpu --backend torch --sizes 2^12 2^13 --dtype fp16 bf16 \
            --block-size 128 2048 --check --far-numel 24576 --reps 1 --warmup 0 --csv "$work/kernels.csv"
        step native_build 120 "${build[@]}"
        step kernels_native 120 "$py" bench/kernels.py --device cpu --backend native --sizes 2^12 --dtype fp16 \
            --block-size 128 --check --reps 1 --warmup 0 --csv "$work/native.csv"
        step kernels_sweep 120 "$py" bench/kernels.py --device cpu --backend torch --sweep --sizes 2^12 --check \
            --tile-elements 2048 4096 --tile-warps 4 --reps 1 --warmup 0 --csv "$work/sweep.csv"
        return
    fi
    # 80 rows: ~40 compiles (~1.2 s), 2 do_bench timings (~0.15 s each), the CPU reference (~25 s in all); past
    # 2^31: ~8 s per dtype. Measured on an H100: 105 s.
    step kernels_main 330 "$py" bench/kernels.py --sizes 2^26 2^28 --dtype fp16 bf16 --block-size 128 2048 --check \
        $ds --csv "$work/kernels.csv"
    # the CUDA C++ kernels (kernels/cuda, through CuPy): the fatbin built here, then the same rows and checks
    step native_build 180 "${build[@]}"
    step kernels_native 240 "$py" bench/kernels.py --backend native --sizes 2^26 2^28 --dtype fp16 bf16 \
        --block-size 128 2048 --check --no-deepspeed --csv "$work/native.csv"
    # 8 rows x 10 tiles (the default among them), ~72 new compiles (~1.2-2 s) and timings of 50 ms of runs.
    # Measured on an H100: 79 s.
    step kernels_sweep 360 "$py" bench/kernels.py --sweep --sizes 2^26 --dtype fp16 --block-size 128 --check \
        --reps 50 --csv "$work/sweep.csv"
}

stage_tests() {
    local pytest=("$py" -m pytest -q -p no:cacheprovider -rfEs) shard=(env "PYTHONPATH=$PWD/bench:$PYTHONPATH")
    # a few threads per process: 7 processes share the machine's cores
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
    if [ $quick = 1 ]; then
        local k="nibble or round_half_to_even or compression_ratio or packed_layout or zero_block"
        for i in 1 2; do
            bg_step "quant_format_${i}of2" 60 "${shard[@]}" "PYTEST_SHARD=$i/2" "${pytest[@]}" -p pytest_shard \
                tests/quant/test_format.py -k "$k"
        done
        bg_step comm_cuda 60 "${pytest[@]}" tests/comm/test_comm_cuda.py -k test_cuda_matches_cpu_reference  # skips
        bg_step fsdp_cuda 60 "${pytest[@]}" tests/fsdp/test_fsdp_cuda.py -k test_cuda_matches_cpu_reference  # skips
        wait
        return
    fi
    # the native kernels must be there: their tests fail rather than skip
    step native_build 180 "${build[@]}"
    export ZEROPP_REQUIRE_NATIVE=1
    for i in 1 2 3 4; do
        bg_step "quant_kernels_${i}of4" 480 "${shard[@]}" "PYTEST_SHARD=$i/4" "${pytest[@]}" -p pytest_shard \
            tests/quant/test_kernels.py
    done
    bg_step quant_format 480 "${pytest[@]}" tests/quant/test_format.py tests/quant/test_exact_arith.py \
        tests/quant/test_reference_speed_invariants.py
    # every launched Triton specialization compiled for sm_90 by this machine's triton, the CUDA C++ kernels by its
    # nvcc: no spills, IEEE division, no FTZ
    # (test_cost_model.py is left to CI: its instruction budgets are pinned under CI's triton version)
    bg_step quant_compile 480 "${pytest[@]}" tests/quant/test_triton_compile.py tests/quant/test_cuda_compile.py
    bg_step comm 480 "${pytest[@]}" tests/comm
    # FSDP2 on a CUDA mesh over gloo with zeropp's comms (Triton kernels) against plain FSDP2 on CPU; its CPU variant
    # runs too (a few seconds). Estimate (no GPU has run it yet): under a minute, most of it Triton's first compiles
    bg_step fsdp_cuda 480 "${pytest[@]}" tests/fsdp/test_fsdp_cuda.py
    bg_step engine_cuda 480 "${pytest[@]}" tests/engine/test_host_syncs.py tests/engine/test_offload_cuda.py
    # DeepSpeed's CUDA quantizer op JIT-built (a minute) against zeropp.deepspeed.ds_format; skips without deepspeed
    bg_step deepspeed_quantizer 480 env DS_ACCELERATOR=cuda TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} \
        "${pytest[@]}" tests/deepspeed/test_quantizer_cuda.py
    wait
}

stage_engine() {
    local run=("$py" -m torch.distributed.run --standalone) dev=(bench/engine_device.py)
    if [ $quick = 1 ]; then
        export OMP_NUM_THREADS=1 ZEROPP_QUANT_BACKEND=torch
        local tiny=(--device cpu --backend gloo --preset tiny --seq 16 --steps 3 --warmup 1)
        step engine_w1_bf16 60 "${run[@]}" --nproc-per-node 1 "${dev[@]}" "${tiny[@]}" --dtype bf16
        step engine_w2_bf16 60 env ZEROPP_RANKS_PER_NODE=1 "${run[@]}" --nproc-per-node 2 "${dev[@]}" "${tiny[@]}" \
            --dtype bf16
        step collectives 60 "${run[@]}" --nproc-per-node 1 -m zeropp.bench.collectives --backend gloo \
            --min-bytes 4K --max-bytes 16K --iters 2 --warmup 1 --csv "$work/collectives.csv"
        return
    fi
    local small=(--device cuda --preset small)
    step engine_w1_nccl_bf16 150 "${run[@]}" --nproc-per-node 1 "${dev[@]}" "${small[@]}" --backend nccl --steps 30 \
        --dtype bf16
    step engine_w4_gloo_bf16 240 env ZEROPP_RANKS_PER_NODE=2 "${run[@]}" --nproc-per-node 4 "${dev[@]}" "${small[@]}" \
        --backend gloo --steps 20 --dtype bf16
    step engine_w1_nccl_fp32 120 "${run[@]}" --nproc-per-node 1 "${dev[@]}" "${small[@]}" --backend nccl --steps 30 \
        --dtype fp32
    step collectives_nccl 120 "${run[@]}" --nproc-per-node 1 -m zeropp.bench.collectives --backend nccl \
        --min-bytes 1M --max-bytes 256M --factor 4 --csv "$work/collectives.csv"
}

echo "=== gpu_check $stage$([ $quick = 1 ] && echo " (--quick)"): budget $budget s, output $out/$stage.tar.gz"
machine
t_start=$SECONDS
"stage_$stage"
elapsed=$((SECONDS - t_start))

"$py" bench/gpu_summary.py "$stage" "$work" > "$work/summary.txt" 2>&1 \
    || { echo "(bench/gpu_summary.py failed; the steps:)"; cat "$work/steps.tsv"; } >> "$work/summary.txt"
failed=$(awk -F'\t' '$2 != "PASS"' "$work/steps.tsv" | wc -l)
steps=$(wc -l < "$work/steps.tsv")
verdict=PASS
[ "$failed" = 0 ] && [ "$steps" -gt 0 ] || verdict=FAIL
summary=$(cat "$work/summary.txt")
if tar -czf "$out/$stage.tar.gz" -C "$out" "$stage"; then
    rm -rf "$work"
    where="$out/$stage.tar.gz ($(wc -c < "$out/$stage.tar.gz") bytes)"
else
    where="$work (packing failed)"
fi
echo
echo "$summary"
echo "gpu_check $stage: $verdict ($((steps - failed)) of $steps steps passed, $elapsed s) -> $where"
[ "$verdict" = PASS ]
