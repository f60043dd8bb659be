#!/usr/bin/env bash
# All of toygraph's pending GPU checks in one device call (see bench/README.md,
# "Before a GPU session, here", for what to prepare first and the exact `run` call).
#
#   run(command="bash bench/gpu_session.sh", carry=[".whl", ".gpu"], timeout_s=600)
#
# Stages, in order; each runs under `timeout` and the script goes on after any failure:
#   setup     install the carried wheels (.whl/*.whl, e.g. gguf) into /tmp/site on PYTHONPATH,
#             pip install --no-deps --no-build-isolation -e .   (always runs)
#   info      nvidia-smi name/driver, versions, toygraph.cuda.driver.available()   (always)
#   kernels   unpack .gpu/kernels.tar.xz (bench/precompile.py, made here) into the cubin cache
#             and say how many modules hit (same kernel sources and NVRTC major.minor)  (always)
#   tests     pytest tests/cuda/test_cuda.py (the GPU suite)                -> $OUT/cuda-tests.log
#             (the NVRTC/ptxas compile tests need no GPU and CI runs them: here they took
#             465 s of NVRTC, so they stay out; the kernels stage checks the carried cubins
#             against the device's NVRTC)
#   nographs  TOYGRAPH_CUDA_GRAPHS=0 pytest tests/cuda/test_cuda.py       -> $OUT/cuda-tests-nographs.log
#   gate      toygraph gate --backend $GS_BACKEND <tiny experiments>  -> $OUT/checks.log
#   golden    each tiny experiment on CUDA twice (+ once with graph replay off): losses
#             vs the CPU golden (its rtol) and bit-identical run to run  -> $OUT/checks.log
#   nccl      bench/nccl_check.py: lora_qv_tiny_llama with the data-parallel all_reduce node
#             on one rank, i.e. ncclAllReduce inside the captured graph, vs the CPU (1e-4)
#             and replay on vs off (identical); needs nccl4py + cuda-core (carry their wheels
#             in .whl) and libnccl.so.2 on the machine   -> $OUT/checks.log
#   slice     SmolLM2 6-block slice (.gpu/smollm2-6l.gguf): forward loss and the
#             lora_qv_smollm2 experiment, CUDA vs CPU within 1e-4 rel  -> $OUT/checks.log
#   bf16loss  bench/bf16_loss.py on the slice: 8 LoRA steps' losses on numpy f32, CUDA f32,
#             CUDA bf16 with f32 buffers and two GEMMs, CUDA bf16 with bf16 activations and
#             the dual GEMM (what --precision bf16 does to the loss) -> $OUT/bench.md
#   generate  bench/bench_generate.py on the slice (GS_BACKEND): greedy tokens/s with and
#             without the KV cache (256 new tokens, GS_GENERATE_ARGS)
#             table -> $OUT/bench.md, JSON in results.json
#   bench     bench/bench_lora.py per GS_BENCH config, or bench/bench_checkpoint.py
#             (activation checkpointing off/on: planned memory, step time) for a ckpt-*
#             entry (last; skipped when time runs out)
#             tables -> $OUT/bench.md, progress -> $OUT/bench.log
#   pack      (not in the default list) bench/bench_packing.py on the slice (the device has
#             no full SmolLM2; its tokenizer is the slice's): real tok/s with and without
#             --pack, LoRA at each GS_PACK shape on the ragged data -> $OUT/bench.md
# Always: $OUT/summary.md (device, date, commands, PASS/FAIL/SKIP/TIMEOUT per stage, rewritten
# after every stage), $OUT/setup.log, $OUT/results.json (golden/slice/bench numbers).
# That is 8 files, the most that comes back from $OUT. The Python side of the stages (the
# golden and slice checks, the summary's detail lines, results.json) is bench/gpu_session.py.
#
# Budget. Device time is 15 minutes per task, the machine's start included (up to ~4
# minutes), and one command runs at most 10: the call is timeout_s=600 and the script ends
# inside GS_BUDGET=540 s, 60 s of margin. Measured 2026-11-28 on the host executor
# (TOYGRAPH_CUDA_DEVICE=host: the same kernels on the CPU; the 2-core project machine,
# shared, nice 10), each stage's command alone and uncapped: its wall time, the part inside
# host-executor kernel launches (what a GPU does in microseconds), and the rest -- Python,
# graph building, realize, CPU references: the host work the GPU machine does too. The
# expectation on the GPU is that host work plus a margin for CUDA's own setup (context,
# module loads, NCCL); caps are each stage's timeout. A stage that would start with under
# 30 s left is skipped, so the order is the priority.
#
#   stage      host executor: wall / in launches (count) / host work   expect on GPU   cap
#   setup      (pip: wheels into /tmp/site, toygraph editable)             ~40 s   60+90
#   info, kernels                                                          ~10 s   30+30
#   tests      217 s / 194 s (27,943) / 23 s  (tests/cuda/test_cuda.py)        ~60 s     120
#   nographs   217 s / 194 s (27,943) / 23 s                               ~60 s     120
#   gate        85 s /  82 s (18,538) /  3 s                               ~15 s      60
#   golden     237 s / 233 s (55,614) /  5 s                               ~25 s      90
#   nccl         7 s /   5 s  (2,380) /  2 s                               ~10 s      60
#   slice      CPU reference of the check alone: ~9 s (numpy both sides: 45 s)  ~30 s   90
#   bf16loss   numpy f32 reference alone (8 steps, 4 x 128): 38 s             ~60 s     120
#   generate   GPU only (the slice, 256 tokens, with and without the cache)   ~45 s      90
#   bench      smollm2-512x8, toygraph and torch eager, no cold child         ~150 s  what is left
#   total      ~465 s expected of 540 (the slowest of these, if all ran to their caps, would
#              push bench out first, then generate)
# The other benchmarks (llama1b-*, smollm2-2048x4, ckpt-*, torch-compile, pack) do not fit
# beside the checks: a later task's session names them (GS_STAGES=bench GS_BENCH=...,
# ~300 s each, two per session).
#
# Knobs (environment):
#   GS_STAGES   comma list of the stages above to run (default: all but pack); setup/info
#               always run. Benchmarks only:  GS_STAGES=bench GS_BENCH=llama1b-random bash ...
#   GS_BENCH    benchmark stages in order (default smollm2-512x8); names: smollm2-512x8,
#               smollm2-2048x4, llama1b-random, llama1b-bf16 (toygraph and torch in bf16),
#               llama1b-bf16-plain (toygraph bf16 without bf16 activations and dual GEMM),
#               ckpt-smollm2-512x8, ckpt-llama1b-2048x4 (bench_checkpoint.py configs)
#   GS_BENCH_ARGS  bench_lora.py arguments for every bench_lora stage (default "--cold no";
#               smollm2-512x8 also runs only toygraph and torch-eager unless this names --impl)
#   GS_GENERATE_ARGS  bench_generate.py arguments (default "--full-tokens 64")
#   GS_PACK     batch x seq shapes of the pack stage (default "8x512 4x2048")
#   GS_PACK_ARGS  bench_packing.py step counts (default "--steps 10 --warmup 2")
#   GS_BUDGET   seconds the whole script may take (default 540: ends inside a 600 s call)
#   GS_SLICE    the SmolLM2 slice (default .gpu/smollm2-6l.gguf)
#   GS_ARCH     arch the kernels stage checks the carried cubins for (default sm_90)
#   GS_BACKEND  backend every stage treats as "the GPU" (default cuda; cpu for a dry run of
#               the plumbing on a machine without one, with GS_SKIP_SETUP=1; or cuda with
#               TOYGRAPH_CUDA_DEVICE=host: the real CUDA lowering on the host executor)
set -u
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
OUT=${OUT:-/tmp/gpu-session-out}
WORK=${GS_WORK:-/tmp/gpu-session}
mkdir -p "$OUT" "$WORK"
rm -f "$WORK"/*.json
BUDGET=${GS_BUDGET:-540}
DEADLINE=$((SECONDS + BUDGET))
RESERVE=20          # seconds kept for results.json and the summary at the end
STAGES=",${GS_STAGES:-tests,nographs,gate,golden,nccl,slice,bf16loss,generate,bench},"
BENCH_LIST=${GS_BENCH:-smollm2-512x8}
SLICE=${GS_SLICE:-.gpu/smollm2-6l.gguf}
GS_BACKEND=${GS_BACKEND:-cuda}
TINY="lora_qv_tiny_llama lora_all_tiny_qwen2 scratch_tiny_llama full_tiny_llama lora_all_tiny_qwen2_ckpt lora_packed_tiny_llama dpo_qv_tiny_llama orpo_qv_tiny_llama"
PY=${PYTHON:-python3}
SUMMARY=$OUT/summary.md
SETUP_LOG=$OUT/setup.log
CHECKS_LOG=$OUT/checks.log

export PYTHONUNBUFFERED=1 TOYGRAPH_OFFLINE=1 PIP_NO_INDEX=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export TOYGRAPH_CACHE=$WORK/cache          # cubins, tiny fixture GGUFs
export TOYGRAPH_BENCH_CACHE=$WORK/bench-cache
unset TOYGRAPH_SMOLLM2                     # only the slice stage points at the slice
START_DATE=$(date -u +%Y-%m-%dT%H:%M:%SZ)
ROWS=()

want() { [[ $STAGES == *",$1,"* ]]; }

write_summary() {
    {
        echo "# toygraph GPU session"
        echo
        echo "- date (UTC): $START_DATE, summary written after ${SECONDS}s of a ${BUDGET}s budget"
        echo "- device: ${DEVICE:-?}"
        echo "- commit: ${COMMIT:-?}"
        echo "- versions: ${VERSIONS:-?}"
        echo "- script: \`bash bench/gpu_session.sh\` (GS_STAGES=${GS_STAGES:-all}; GS_BENCH=$BENCH_LIST; GS_BENCH_ARGS=${GS_BENCH_ARGS:-}; GS_BACKEND=$GS_BACKEND${TOYGRAPH_CUDA_DEVICE:+; TOYGRAPH_CUDA_DEVICE=$TOYGRAPH_CUDA_DEVICE})"
        echo
        echo "| stage | result | s | command | detail |"
        echo "|---|---|---|---|---|"
        local r
        for r in "${ROWS[@]}"; do echo "$r"; done
        echo
        echo "Logs: setup.log, cuda-tests.log, cuda-tests-nographs.log, checks.log (gate, golden,"
        echo "slice), bench.md (tables), bench.log (bench progress); numbers in results.json."
    } > "$SUMMARY"
}

row() {  # row STAGE RESULT SECONDS COMMAND DETAIL
    local detail=${5//|/\\|}
    ROWS+=("| $1 | **$2** | $3 | \`${4//|/\\|}\` | ${detail//$'\n'/; } |")
    echo "[gpu_session ${SECONDS}s] $1: $2 ($3 s) ${5//$'\n'/; }"
    write_summary
}

# stage NAME CAP LOG DETAIL_CMD COMMAND: run COMMAND (a bash string) under timeout, appending
# stdout+stderr to LOG; DETAIL_CMD (a bash string, may be empty) prints the detail column.
stage() {
    local name=$1 cap=$2 log=$3 detail_cmd=$4 cmd=$5
    local left=$((DEADLINE - SECONDS - RESERVE))
    local t=$((cap < left ? cap : left))
    if ((t < 30)); then
        row "$name" SKIP 0 "$cmd" "not started: ${left}s left of the budget"
        return 0
    fi
    echo "[gpu_session ${SECONDS}s] $name: start (timeout ${t}s): $cmd"
    printf '\n===== %s (timeout %ss) %s\n$ %s\n' "$name" "$t" "$(date -u +%H:%M:%S)" "$cmd" >> "$log"
    local t0=$SECONDS rc
    timeout -k 15 "$t" bash -c "$cmd" >> "$log" 2>&1
    rc=$?
    local dt=$((SECONDS - t0)) res detail=""
    case $rc in
        0) res=PASS ;;
        124|137) res=TIMEOUT ;;
        *) res="FAIL (rc $rc)" ;;
    esac
    [[ -n $detail_cmd ]] && detail=$(bash -c "$detail_cmd" 2>/dev/null | tr -d '\r' | head -c 1200)
    if [[ -z $detail && $rc != 0 ]]; then  # say why: the log's last lines
        detail=$(grep -v -e '^=====' -e '^\$ ' -e '^$' "$log" | tail -n 2 | cut -c1-300)
    fi
    printf '===== %s: %s in %ss\n' "$name" "$res" "$dt" >> "$log"
    row "$name" "$res" "$dt" "$cmd" "$detail"
    return 0
}

# slice_stage: `stage` with the same arguments when the SmolLM2 slice is there, else a SKIP row
slice_stage() {
    if [[ -f $SLICE ]]; then
        stage "$@"
    else
        row "$1" SKIP 0 "-" "no $SLICE: make it here with bench/slice_gguf.py and carry .gpu"
    fi
}

# pytest's last summary line, and a warning when the GPU module was skipped as a whole
pytest_detail() {  # pytest_detail LOG
    echo "tail -n 400 '$1' | grep -E '(passed|failed|skipped|error|no tests ran)' | grep -E ' in [0-9.]+s' | tail -n 1;
          grep -q 'no CUDA device' '$1' && echo ' WARNING: test_cuda.py skipped: no CUDA device';
          grep -E '^(FAILED|ERROR) ' '$1' | head -n 8 | cut -c1-160"
}

# ---------------------------------------------------------------------------------------------
# setup (always)
write_summary
: > "$SETUP_LOG"
if [[ ${GS_SKIP_SETUP:-0} == 1 ]]; then
    row setup SKIP 0 "GS_SKIP_SETUP=1" "using the environment as it is"
else
    shopt -s nullglob
    wheels=(.whl/*.whl)
    shopt -u nullglob
    if ((${#wheels[@]})); then
        stage setup-wheels 60 "$SETUP_LOG" "ls .whl" \
            "$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl"
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    else
        row setup-wheels "FAIL (no .whl/*.whl)" 0 "ls .whl" "no wheels carried: gguf is missing there (carry [\".whl\", \".gpu\"])"
    fi
    stage setup-toygraph 90 "$SETUP_LOG" "" \
        "$PY -m pip install -q --no-index --no-deps --no-build-isolation -e ."
fi

# info (always)
DEVICE=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -n 1)
DEVICE=${DEVICE:-no nvidia-smi}
# The commit comes from .gpu/commit.txt, written here before the call (bench/README.md,
# "Before a GPU session, here"): the device's .git, where it has one, can be the session's
# first snapshot (2026-11-28 it said c5d0f27-dirty of a tree at 5f77feb)
COMMIT=$({ [[ -f .gpu/commit.txt ]] && echo "$(head -c 200 .gpu/commit.txt) (.gpu/commit.txt)"; } \
         || git -C "$ROOT" describe --always --dirty 2>/dev/null \
         || echo "unknown (no .gpu/commit.txt, no .git)")
VERSIONS=$($PY bench/gpu_session.py versions 2>>"$SETUP_LOG")
{ echo "== nvidia-smi"; nvidia-smi 2>&1 | head -n 20; echo "== versions: $VERSIONS"; } >> "$SETUP_LOG"
stage info 30 "$SETUP_LOG" "tail -n 1 '$SETUP_LOG'" "$PY bench/gpu_session.py info"
echo "[gpu_session] device: $DEVICE | $VERSIONS"

# kernels compiled ahead (bench/precompile.py, here): unpacked into $TOYGRAPH_CACHE so the
# stages load cubins instead of compiling them; both lent kinds (H100, H200) are sm_90
if [[ -f .gpu/kernels.tar.xz ]]; then
    stage kernels 30 "$SETUP_LOG" "tail -n 1 '$SETUP_LOG'" \
        "$PY bench/precompile.py --unpack .gpu/kernels.tar.xz --arch ${GS_ARCH:-sm_90}"
else
    row kernels SKIP 0 "-" "no .gpu/kernels.tar.xz (python bench/precompile.py here): kernels compile on first use"
fi

# pytest options: per-test timeout where pytest-timeout is there, so one hang cannot eat the stage
PT_OPTS="-q --durations=15 --maxfail=40"
$PY -c 'import pytest_timeout' 2>/dev/null && PT_OPTS="$PT_OPTS --timeout=120 --timeout-method=thread"

if want tests; then
    stage tests 120 "$OUT/cuda-tests.log" "$(pytest_detail "$OUT/cuda-tests.log")" \
        "$PY -m pytest $PT_OPTS tests/cuda/test_cuda.py"
fi
if want nographs; then
    stage nographs 120 "$OUT/cuda-tests-nographs.log" "$(pytest_detail "$OUT/cuda-tests-nographs.log")" \
        "TOYGRAPH_CUDA_GRAPHS=0 $PY -m pytest $PT_OPTS tests/cuda/test_cuda.py"
fi
if want gate; then
    stage gate 60 "$CHECKS_LOG" "$PY bench/gpu_session.py check-detail '$CHECKS_LOG' gate" \
        "$PY -m toygraph.cli gate --backend $GS_BACKEND $TINY"
fi
if want golden; then
    stage golden 90 "$CHECKS_LOG" "$PY bench/gpu_session.py check-detail '$CHECKS_LOG' golden" \
        "GS_BACKEND=$GS_BACKEND $PY bench/gpu_session.py golden $WORK/golden.json $TINY"
fi
if want nccl; then
    stage nccl 60 "$CHECKS_LOG" "$PY bench/gpu_session.py check-detail '$CHECKS_LOG' nccl" \
        "GS_BACKEND=$GS_BACKEND $PY bench/nccl_check.py $WORK/nccl.json lora_qv_tiny_llama"
fi
if want slice; then
    slice_stage slice 90 "$CHECKS_LOG" "$PY bench/gpu_session.py check-detail '$CHECKS_LOG' slice" \
        "GS_BACKEND=$GS_BACKEND $PY bench/gpu_session.py slice $SLICE $WORK/slice.json"
fi
if want bf16loss; then
    slice_stage bf16loss 120 "$OUT/bench.log" "tail -n 6 $WORK/bf16loss.md" \
        "set -o pipefail; TOYGRAPH_CUDA_DEVICE=\${TOYGRAPH_CUDA_DEVICE:-0} $PY bench/bf16_loss.py --gguf $SLICE --steps 8 --batch 4 --seq-len 128 --md $WORK/bf16loss.md --json $WORK/bench-bf16loss.json | tee -a $OUT/bench.md >&2"
fi
if want generate; then
    slice_stage generate 90 "$OUT/bench.log" "tail -n 1 $WORK/generate.md" \
        "set -o pipefail; $PY bench/bench_generate.py --backend $GS_BACKEND --model $SLICE ${GS_GENERATE_ARGS:---full-tokens 64} --md $WORK/generate.md --json $WORK/bench-generate.json --note 'gpu_session.sh generate (SmolLM2 6-block slice)' | tee -a $OUT/bench.md >&2"
fi
if want bench; then
    for b in $BENCH_LIST; do
        script=bench/bench_lora.py extra=${GS_BENCH_ARGS-"--cold no"} pre=""
        case $b in
            ckpt-*) script=bench/bench_checkpoint.py extra=""
                    args="--config ${b#ckpt-} --steps 3 --warmup 1"; cap=300 ;;
            llama1b-bf16) args="--config llama1b-random --dtype bf16 --impl toygraph,torch-eager,torch-compile"; cap=240 ;;
            # the same step with bf16 activations and the dual GEMM off: what they are worth
            llama1b-bf16-plain) args="--config llama1b-random --dtype bf16 --impl toygraph"; cap=180
                    pre="TOYGRAPH_CUDA_BF16_ACTIVATIONS=0 TOYGRAPH_CUDA_DUAL_GEMM=0" ;;
            # the default: what fits beside the checks (torch-compile's compile does not)
            smollm2-512x8) args="--config $b"; cap=300
                    [[ $extra == *--impl* ]] || args="$args --impl toygraph,torch-eager" ;;
            *) args="--config $b"; cap=300 ;;
        esac
        stage "bench $b" "$cap" "$OUT/bench.log" \
            "$PY bench/gpu_session.py bench-detail $WORK/bench-$b.json" \
            "set -o pipefail; $pre $PY $script --device $GS_BACKEND $args $extra --json $WORK/bench-$b.json --note 'gpu_session.sh $b' | tee -a $OUT/bench.md >&2"
    done
fi

if want pack; then
    for shape in ${GS_PACK:-8x512 4x2048}; do
        batch=${shape%x*} seq=${shape#*x}
        slice_stage "pack $shape" 150 "$OUT/bench.log" \
            "$PY bench/gpu_session.py pack-detail $WORK/bench-pack-$shape.json" \
            "set -o pipefail; $PY bench/bench_packing.py --backend $GS_BACKEND --model $SLICE --batch $batch --seq-len $seq ${GS_PACK_ARGS:---steps 10 --warmup 2} --json $WORK/bench-pack-$shape.json --note 'gpu_session.sh pack $shape' | tee -a $OUT/bench.md >&2"
    done
fi

$PY bench/gpu_session.py merge "$WORK" "$OUT/results.json" 2>>"$SETUP_LOG"
write_summary
echo
cat "$SUMMARY"
ls -la "$OUT"
exit 0
