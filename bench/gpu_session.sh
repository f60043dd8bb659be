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
#   tests     pytest tests/test_cuda.py (the GPU suite) tests/test_cuda_compile.py, and the
#             families' NVRTC/ptxas tests (-k compile in tests/test_ops_*_cuda.py and
#             tests/test_ops_gemm*.py; their numpy replays need no GPU: CI runs them)
#                                                                   -> $OUT/cuda-tests.log
#   nographs  TOYGRAPH_CUDA_GRAPHS=0 pytest tests/test_cuda.py       -> $OUT/cuda-tests-nographs.log
#   gate      toygraph gate --backend $GS_BACKEND <tiny experiments>  -> $OUT/checks.log
#   golden    each tiny experiment on CUDA twice (+ once with graph replay off): losses
#             vs the CPU golden (its rtol) and bit-identical run to run  -> $OUT/checks.log
#   nccl      bench/nccl_check.py: lora_qv_tiny_llama with the data-parallel all_reduce node
#             on one rank, i.e. ncclAllReduce inside the captured graph, vs the CPU (1e-4)
#             and replay on vs off (identical); needs nccl4py + cuda-core (carry their wheels
#             in .whl) and libnccl.so.2 on the machine   -> $OUT/checks.log
#   slice     SmolLM2 8-block slice (.gpu/smollm2-8l.gguf): forward loss and the
#             lora_qv_smollm2 experiment, CUDA vs CPU within 1e-4 rel  -> $OUT/checks.log
#   bf16loss  bench/bf16_loss.py on the slice: 8 LoRA steps' losses on numpy f32, CUDA f32,
#             CUDA bf16 with f32 buffers and two GEMMs, CUDA bf16 with bf16 activations and
#             the dual GEMM (what --precision bf16 does to the loss) -> $OUT/bench.md
#   generate  bench/bench_generate.py on the slice (GS_BACKEND): greedy tokens/s with and
#             without the KV cache (256 new tokens, GS_GENERATE_ARGS)
#             table -> $OUT/bench.md, JSON in results.json
#   bench     bench/bench_lora.py per GPU config, then bench/bench_checkpoint.py (activation
#             checkpointing off/on: planned memory, step time) for the ckpt-* entries
#             (last; skipped when time runs out)
#             tables -> $OUT/bench.md, progress -> $OUT/bench.log
#   pack      bench/bench_packing.py on the slice (the device has no full SmolLM2; its tokenizer
#             is the slice's): real tok/s with and without --pack, LoRA at each GS_PACK shape
#             on the ragged data -> $OUT/bench.md, $OUT/bench.log
# Always: $OUT/summary.md (device, date, commands, PASS/FAIL/SKIP/TIMEOUT per stage, rewritten
# after every stage), $OUT/setup.log, $OUT/results.json (golden/slice/bench numbers).
# That is 8 files, the most that comes back from $OUT.
#
# Knobs (environment):
#   GS_STAGES   comma list of the stages above to run (default: all); setup/info always run.
#               Second call for the benchmarks only:  GS_STAGES=bench bash bench/gpu_session.sh
#   GS_BENCH    benchmark stages in order (default below); names: smollm2-512x8,
#               smollm2-2048x4, llama1b-random, llama1b-bf16 (toygraph and torch in bf16),
#               llama1b-bf16-plain (toygraph bf16 without bf16 activations and dual GEMM),
#               ckpt-smollm2-512x8, ckpt-llama1b-2048x4 (bench_checkpoint.py configs)
#   GS_BENCH_ARGS  extra bench_lora.py arguments for every bench_lora stage (e.g. "--cold no")
#   GS_GENERATE_ARGS  bench_generate.py arguments (default "--full-tokens 64")
#   GS_PACK     batch x seq shapes of the pack stage (default "8x512 4x2048")
#   GS_PACK_ARGS  bench_packing.py step counts (default "--steps 10 --warmup 2")
#   GS_BUDGET   seconds the whole script may take (default 540: ends inside a 600 s call)
#   GS_SLICE    the SmolLM2 slice (default .gpu/smollm2-8l.gguf)
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
STAGES=",${GS_STAGES:-tests,nographs,gate,golden,nccl,slice,bf16loss,generate,bench,pack},"
BENCH_LIST=${GS_BENCH:-smollm2-512x8 llama1b-random smollm2-2048x4 llama1b-bf16 llama1b-bf16-plain ckpt-smollm2-512x8 ckpt-llama1b-2048x4}
SLICE=${GS_SLICE:-.gpu/smollm2-8l.gguf}
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
# Python helpers, written to $WORK
cat > "$WORK/golden_check.py" <<'EOF'
"""Each tiny experiment on the GPU backend twice (graph replay on) and once with
TOYGRAPH_CUDA_GRAPHS=0: per-step losses vs the CPU golden (its rtol), and bit-identity."""
import json, os, sys, time, traceback
import numpy as np
from toygraph.fixtures.experiments import EXPERIMENTS, run_experiment
from toygraph.fixtures.golden import golden_path

backend, out, names = os.environ.get("GS_BACKEND", "cuda"), sys.argv[1], sys.argv[2:]
res, ok_all = {}, True
for name in names:
    r = res[name] = {"backend": backend}
    try:
        doc = json.loads(golden_path(name, "cpu").read_text())
        want, rtol = np.array(doc["losses"]), doc["tolerance"]["rtol"]
        runs = []
        for graphs in ("1", "1", "0"):
            os.environ["TOYGRAPH_CUDA_GRAPHS"] = graphs
            t0 = time.perf_counter()
            runs.append([float(x) for x in run_experiment(EXPERIMENTS[name], backend=backend)])
            r.setdefault("seconds", []).append(round(time.perf_counter() - t0, 2))
        os.environ["TOYGRAPH_CUDA_GRAPHS"] = "1"
        a = np.array(runs[0])
        rel = np.abs(a - want) / np.maximum(np.abs(want), 1e-12)
        r.update(losses=runs[0], golden_cpu=want.tolist(), rtol=rtol,
                 max_rel_vs_cpu=float(rel.max()), worst_step=int(rel.argmax()) + 1,
                 bit_identical_twice=runs[0] == runs[1],
                 bit_identical_graphs_off=runs[0] == runs[2])
        if runs[0] != runs[1]:
            r["second_run"] = runs[1]
        if runs[0] != runs[2]:
            r["graphs_off_run"] = runs[2]
        ok = bool(rel.max() <= rtol) and r["bit_identical_twice"] and r["bit_identical_graphs_off"]
    except Exception:
        r["error"] = traceback.format_exc()
        print(r["error"], file=sys.stderr)
        ok = False
    r["ok"] = ok
    ok_all &= ok
    print(f"{'PASS' if ok else 'FAIL'} {name}: " + (
        f"max rel vs cpu golden {r['max_rel_vs_cpu']:.2e} at step {r['worst_step']} "
        f"(rtol {r['rtol']:.0e}); twice identical {r['bit_identical_twice']}; "
        f"graphs-off identical {r['bit_identical_graphs_off']}; "
        f"loss {r['losses'][0]:.6f} -> {r['losses'][-1]:.6f}; s {r['seconds']}"
        if "error" not in r else r["error"].strip().splitlines()[-1]), flush=True)
json.dump(res, open(out, "w"), indent=1)
sys.exit(0 if ok_all else 1)
EOF

cat > "$WORK/slice_check.py" <<'EOF'
"""SmolLM2 8-block slice: forward loss on real text and the lora_qv_smollm2 experiment
(4 LoRA steps, capitals data), GPU backend vs CPU within 1e-4 relative; GPU twice identical."""
import json, os, sys, time, traceback
from pathlib import Path
import numpy as np

path, out = Path(sys.argv[1]).resolve(), sys.argv[2]
os.environ["TOYGRAPH_SMOLLM2"] = str(path)
backend, RTOL = os.environ.get("GS_BACKEND", "cuda"), 1e-4
from toygraph.models.model import GGUFModel
from toygraph.inference.language_model import LanguageModel
from toygraph.gguf.tokenizer import Tokenizer


def fwd_loss(tokens, be):
    """Mean next-token cross-entropy of each row of ``tokens`` on backend ``be``."""
    return LanguageModel(str(path), backend=be).loss([list(map(int, r)) for r in tokens])[0]


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float((np.abs(a - b) / np.maximum(np.abs(b), 1e-12)).max())


res, ok_all = {"gguf": str(path), "bytes": path.stat().st_size, "backend": backend}, True
try:
    cfg = GGUFModel(path).config
    res["config"] = {"n_layer": cfg.n_layer, "n_embd": cfg.n_embd, "n_vocab": cfg.n_vocab}
    tok = Tokenizer.from_gguf(path)
    texts = ["The capital of France is Paris. It is known for the Eiffel Tower and",
             "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # prints 5, of course"]
    ids = [tok.encode(t) for t in texts]
    T = min(len(i) for i in ids)
    tokens = np.array([i[:T] for i in ids], np.int32)
    t0 = time.perf_counter()
    cpu, gpu, gpu2 = fwd_loss(tokens, "cpu"), fwd_loss(tokens, backend), fwd_loss(tokens, backend)
    ok = rel(gpu, cpu) <= RTOL and gpu == gpu2
    res["forward"] = {"tokens": list(tokens.shape), "cpu": cpu, "gpu": gpu, "gpu_again": gpu2,
                      "rel": rel(gpu, cpu), "identical": gpu == gpu2, "ok": ok,
                      "seconds": round(time.perf_counter() - t0, 2)}
    print(f"{'PASS' if ok else 'FAIL'} forward {tokens.shape}: cpu {cpu:.7f} {backend} {gpu:.7f} "
          f"rel {rel(gpu, cpu):.2e}; again identical {gpu == gpu2}", flush=True)
    ok_all &= ok
except Exception:
    res["forward_error"] = traceback.format_exc()
    print(res["forward_error"], file=sys.stderr)
    print(f"FAIL forward: {res['forward_error'].strip().splitlines()[-1]}", flush=True)
    ok_all = False
try:
    from toygraph.fixtures.experiments import EXPERIMENTS, run_experiment
    exp = EXPERIMENTS["lora_qv_smollm2"]
    t0 = time.perf_counter()
    cpu = [float(x) for x in run_experiment(exp, backend="cpu")]
    t1 = time.perf_counter()
    gpu = [float(x) for x in run_experiment(exp, backend=backend)]
    gpu2 = [float(x) for x in run_experiment(exp, backend=backend)]
    ok = rel(gpu, cpu) <= RTOL and gpu == gpu2
    res["lora_qv_smollm2"] = {"cpu": cpu, "gpu": gpu, "gpu_again": gpu2, "rel": rel(gpu, cpu),
                              "identical": gpu == gpu2, "ok": ok,
                              "seconds_cpu": round(t1 - t0, 2),
                              "seconds_gpu_x2": round(time.perf_counter() - t1, 2)}
    print(f"{'PASS' if ok else 'FAIL'} lora_qv_smollm2 on the slice ({len(cpu)} steps): max rel "
          f"{rel(gpu, cpu):.2e}; loss cpu {cpu[0]:.6f} -> {cpu[-1]:.6f}, {backend} {gpu[0]:.6f} -> "
          f"{gpu[-1]:.6f}; again identical {gpu == gpu2}", flush=True)
    ok_all &= ok
except Exception:
    res["lora_error"] = traceback.format_exc()
    print(res["lora_error"], file=sys.stderr)
    print(f"FAIL lora_qv_smollm2: {res['lora_error'].strip().splitlines()[-1]}", flush=True)
    ok_all = False
res["ok"] = ok_all
json.dump(res, open(out, "w"), indent=1)
sys.exit(0 if ok_all else 1)
EOF

cat > "$WORK/check_detail.py" <<'EOF'
"""The PASS/FAIL lines one check stage wrote to LOG (after its last header): the counts,
then every FAIL line, or the last PASS lines when none failed."""
import sys
log, name = sys.argv[1], sys.argv[2]
lines = open(log, errors="replace").read().splitlines()
start = max((i for i, l in enumerate(lines) if l.startswith(f"===== {name} (timeout")), default=0)
res = [l for l in lines[start:] if l.startswith(("PASS ", "FAIL "))]
fails = [l for l in res if l.startswith("FAIL ")]
print(f"{len(res) - len(fails)} PASS, {len(fails)} FAIL: "
      + "; ".join(l[:220] for l in (fails or res[-2:])))
EOF

cat > "$WORK/bench_detail.py" <<'EOF'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception:
    print("no JSON written"); sys.exit(0)
parts = []
for r in d.get("rows", []):
    ms = r.get("step_ms")
    parts.append(f"{r.get('impl')} {r.get('dtype')}: "
                 + (f"{r.get('tokens_per_s', 0):.0f} tok/s, {ms:.1f} ms" if ms else "no timing"))
print("; ".join(parts) or "no rows")
EOF

cat > "$WORK/pack_detail.py" <<'EOF'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception:
    print("no JSON written"); sys.exit(0)
print("; ".join(f"{'packed' if r['pack'] else 'unpacked'} {r['real_tok_s']:.0f} real tok/s "
                f"({r['timed_efficiency']:.0%} real)" for r in d["rows"])
      + f"; speedup {d['speedup']:.2f}x")
EOF

cat > "$WORK/merge_results.py" <<'EOF'
import json, sys
from pathlib import Path
work, out = Path(sys.argv[1]), sys.argv[2]
doc = {"golden": None, "slice": None, "nccl": None, "bench": {}}
for p in sorted(work.glob("*.json")):
    try:
        d = json.loads(p.read_text())
    except Exception as e:
        d = {"unreadable": str(e)}
    if p.stem == "golden":
        doc["golden"] = d
    elif p.stem in ("slice", "nccl"):
        doc[p.stem] = d
    elif p.stem.startswith("bench-"):
        doc["bench"][p.stem[len("bench-"):]] = d
json.dump(doc, open(out, "w"), indent=1)
EOF

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
        stage setup-wheels 120 "$SETUP_LOG" "ls .whl" \
            "$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl"
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    else
        row setup-wheels "FAIL (no .whl/*.whl)" 0 "ls .whl" "no wheels carried: gguf is missing there (carry [\".whl\", \".gpu\"])"
    fi
    stage setup-toygraph 180 "$SETUP_LOG" "" \
        "$PY -m pip install -q --no-index --no-deps --no-build-isolation -e ."
fi

# info (always)
DEVICE=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -n 1)
DEVICE=${DEVICE:-no nvidia-smi}
# .git does not travel to the device: there the commit comes from .gpu/commit.txt, written
# here before the call (bench/README.md, "Before a GPU session, here")
COMMIT=$(git -C "$ROOT" describe --always --dirty 2>/dev/null \
         || { [[ -f .gpu/commit.txt ]] && echo "$(head -c 200 .gpu/commit.txt) (.gpu/commit.txt)"; } \
         || echo "unknown (no .git, no .gpu/commit.txt)")
VERSIONS=$($PY - <<'EOF' 2>>"$SETUP_LOG"
import importlib.metadata as md, platform
def v(p):
    try:
        return md.version(p)
    except Exception:
        return "-"
print(f"python {platform.python_version()}, " + ", ".join(f"{p} {v(p)}" for p in
      ("numpy", "gguf", "cuda-bindings", "nvidia-cuda-nvrtc", "torch", "transformers", "peft", "toygraph")))
EOF
)
{ echo "== nvidia-smi"; nvidia-smi 2>&1 | head -n 20; echo "== versions: $VERSIONS"; } >> "$SETUP_LOG"
stage info 60 "$SETUP_LOG" "tail -n 1 '$SETUP_LOG'" \
    "$PY -c 'import gguf, toygraph.fixtures.experiments; from toygraph.cuda import driver; ok = driver.available(); print(\"gguf\", gguf.__file__, \"| cuda available:\", ok, \"| arch:\", driver.device_arch() if ok else \"-\")'"
echo "[gpu_session] device: $DEVICE | $VERSIONS"

# kernels compiled ahead (bench/precompile.py, here): unpacked into $TOYGRAPH_CACHE so the
# stages load cubins instead of compiling them; both lent kinds (H100, H200) are sm_90
if [[ -f .gpu/kernels.tar.xz ]]; then
    stage kernels 60 "$SETUP_LOG" "tail -n 1 '$SETUP_LOG'" \
        "$PY bench/precompile.py --unpack .gpu/kernels.tar.xz --arch ${GS_ARCH:-sm_90}"
else
    row kernels SKIP 0 "-" "no .gpu/kernels.tar.xz (python bench/precompile.py here): kernels compile on first use"
fi

# pytest options: per-test timeout where pytest-timeout is there, so one hang cannot eat the stage
PT_OPTS="-q --durations=15 --maxfail=40"
$PY -c 'import pytest_timeout' 2>/dev/null && PT_OPTS="$PT_OPTS --timeout=120 --timeout-method=thread"

if want tests; then
    stage tests 240 "$OUT/cuda-tests.log" "$(pytest_detail "$OUT/cuda-tests.log")" \
        "$PY -m pytest $PT_OPTS -k 'test_cuda.py or compile' tests/test_cuda.py tests/test_cuda_compile.py tests/test_ops_*_cuda.py tests/test_ops_gemm*.py"
fi
if want nographs; then
    stage nographs 150 "$OUT/cuda-tests-nographs.log" "$(pytest_detail "$OUT/cuda-tests-nographs.log")" \
        "TOYGRAPH_CUDA_GRAPHS=0 $PY -m pytest $PT_OPTS tests/test_cuda.py"
fi
if want gate; then
    stage gate 120 "$CHECKS_LOG" "$PY $WORK/check_detail.py '$CHECKS_LOG' gate" \
        "$PY -m toygraph.cli gate --backend $GS_BACKEND $TINY"
fi
if want golden; then
    stage golden 180 "$CHECKS_LOG" "$PY $WORK/check_detail.py '$CHECKS_LOG' golden" \
        "GS_BACKEND=$GS_BACKEND $PY $WORK/golden_check.py $WORK/golden.json $TINY"
fi
if want nccl; then
    stage nccl 150 "$CHECKS_LOG" "$PY $WORK/check_detail.py '$CHECKS_LOG' nccl" \
        "GS_BACKEND=$GS_BACKEND $PY bench/nccl_check.py $WORK/nccl.json lora_qv_tiny_llama"
fi
if want slice; then
    slice_stage slice 180 "$CHECKS_LOG" "$PY $WORK/check_detail.py '$CHECKS_LOG' slice" \
        "GS_BACKEND=$GS_BACKEND $PY $WORK/slice_check.py $SLICE $WORK/slice.json"
fi
if want bf16loss; then
    slice_stage bf16loss 200 "$OUT/bench.log" "tail -n 6 $WORK/bf16loss.md" \
        "set -o pipefail; TOYGRAPH_CUDA_DEVICE=\${TOYGRAPH_CUDA_DEVICE:-0} $PY bench/bf16_loss.py --gguf $SLICE --steps 8 --batch 4 --seq-len 128 --md $WORK/bf16loss.md --json $WORK/bench-bf16loss.json | tee -a $OUT/bench.md >&2"
fi
if want generate; then
    slice_stage generate 150 "$OUT/bench.log" "tail -n 1 $WORK/generate.md" \
        "set -o pipefail; $PY bench/bench_generate.py --backend $GS_BACKEND --model $SLICE ${GS_GENERATE_ARGS:---full-tokens 64} --md $WORK/generate.md --json $WORK/bench-generate.json --note 'gpu_session.sh generate (SmolLM2 8-block slice)' | tee -a $OUT/bench.md >&2"
fi
if want bench; then
    for b in $BENCH_LIST; do
        script=bench/bench_lora.py extra=${GS_BENCH_ARGS:-} pre=""
        case $b in
            ckpt-*) script=bench/bench_checkpoint.py extra=""
                    args="--config ${b#ckpt-} --steps 3 --warmup 1"; cap=300 ;;
            llama1b-bf16) args="--config llama1b-random --dtype bf16 --impl toygraph,torch-eager,torch-compile"; cap=240 ;;
            # the same step with bf16 activations and the dual GEMM off: what they are worth
            llama1b-bf16-plain) args="--config llama1b-random --dtype bf16 --impl toygraph"; cap=180
                    pre="TOYGRAPH_CUDA_BF16_ACTIVATIONS=0 TOYGRAPH_CUDA_DUAL_GEMM=0" ;;
            smollm2-512x8) args="--config $b"; cap=300 ;;
            *) args="--config $b"; cap=300 ;;
        esac
        stage "bench $b" "$cap" "$OUT/bench.log" \
            "$PY $WORK/bench_detail.py $WORK/bench-$b.json" \
            "set -o pipefail; $pre $PY $script --device $GS_BACKEND $args $extra --json $WORK/bench-$b.json --note 'gpu_session.sh $b' | tee -a $OUT/bench.md >&2"
    done
fi

if want pack; then
    for shape in ${GS_PACK:-8x512 4x2048}; do
        batch=${shape%x*} seq=${shape#*x}
        slice_stage "pack $shape" 150 "$OUT/bench.log" \
            "$PY $WORK/pack_detail.py $WORK/bench-pack-$shape.json" \
            "set -o pipefail; $PY bench/bench_packing.py --backend $GS_BACKEND --model $SLICE --batch $batch --seq-len $seq ${GS_PACK_ARGS:---steps 10 --warmup 2} --json $WORK/bench-pack-$shape.json --note 'gpu_session.sh pack $shape' | tee -a $OUT/bench.md >&2"
    done
fi

$PY "$WORK/merge_results.py" "$WORK" "$OUT/results.json" 2>>"$SETUP_LOG"
write_summary
echo
cat "$SUMMARY"
ls -la "$OUT"
exit 0
