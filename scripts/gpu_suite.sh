#!/usr/bin/env bash
# One-shot GPU validation suite: build, tests, compute-sanitizer, benchmarks.
#
#   bash scripts/gpu_suite.sh [STEP ...]
#
# Steps (run in this order, whatever order they are given in):
#   build       MAX_JOBS=16 python3 setup.py build_ext --inplace (clean unless CLEAN_BUILD=0)
#   ptxas       python3 scripts/check_sm75.py --json $OUT/ptxas.json   (only if the script exists)
#   test        python3 -m pytest -q -p no:cacheprovider tests  (junit xml -> $OUT/junit.xml)
#   sanitize    compute-sanitizer memcheck + racecheck on scripts/sanitize_driver.py
#   bench       benchmarks/bench_forward.py full sweep + decode shapes (~3 min)
#   bench-quick benchmarks/bench_forward.py --quick --decode (~1 min)
#   extra       benchmarks/bench_e2e_hf.py --quick and benchmarks/bench_backward.py, if present
#   all         = build ptxas test sanitize bench extra (more than one 10-minute call!)
# Default (no arguments): build ptxas test bench   (fits in ~8 minutes).
#
# Steps that need the extension build it first when this machine has not built the current
# sources yet (stamp in /tmp), so `bash scripts/gpu_suite.sh sanitize` works on a fresh machine.
#
# Output ($OUT, default ./gpu_suite_out), kept to <= 8 flat files:
#   summary.txt  logs.tar.gz (every step's log + bench outputs)  junit.xml  ptxas.json
#   bench_forward.json  bench_forward.png  bench_forward.txt
# The last thing printed is a digest (test summary, sanitizer summaries, benchmark table) and
# the per-step status table.
#
# Knobs (environment): OUT, MAX_JOBS (16), CLEAN_BUILD (1), BUILD_TIMEOUT (420), TEST_TIMEOUT
# (300), SANITIZE_TIMEOUT (240 per tool), SANITIZE_TOOLS ("memcheck racecheck"), BENCH_TIMEOUT
# (330), BENCH_ARGS (extra args for bench_forward.py), EXTRA_TIMEOUT (240), PYTEST_ARGS,
# PYTEST_WORKERS (0; N runs pytest-xdist with N processes, from wheels in .whl/ if needed),
# ASSUME_BUILT=1 (trust an importable extension instead of rebuilding on a fresh machine),
# TEST_PART (one or more of A1 A2 B C D E: the test files in groups that each fit one
# 10-minute call with PYTEST_WORKERS=15 on an H100/H200, test_paths below; unset: all of tests/).

set -u -o pipefail
export PYTHONUNBUFFERED=1

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
REPO=$PWD
OUT=${OUT:-$REPO/gpu_suite_out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d /tmp/gpu_suite.XXXXXX)
LOGS=$WORK/logs
BENCH=$WORK/bench
CACHE=/tmp/gpu_suite_cache          # mma_peak binary; not shipped back
STAMP=/tmp/gpu_suite_build.stamp    # hash of the sources this machine last built
mkdir -p "$LOGS" "$BENCH" "$CACHE"

export MAX_JOBS=${MAX_JOBS:-16}
# The GPU machine's image presets TORCH_CUDA_ARCH_LIST=9.0a; we test the Turing build (sm_75 SASS
# + compute_75 PTX that the driver JIT-compiles for the H200). Override with SUITE_ARCH_LIST.
export TORCH_CUDA_ARCH_LIST="${SUITE_ARCH_LIST:-7.5+PTX}"
# The image also presets CC/CXX=/opt/gcc/bin/gcc: with it, std::ostream formatting of integers
# inside our library (every TORCH_CHECK message with a number) segfaults at run time
# (libstdc++ facet mismatch; cuda-gdb backtrace in DESIGN.md). Build with the system compiler.
if [ -x /usr/bin/g++ ] && [ -z "${SUITE_KEEP_CXX:-}" ]; then export CC=/usr/bin/gcc CXX=/usr/bin/g++; fi
CLEAN_BUILD=${CLEAN_BUILD:-1}
BUILD_TIMEOUT=${BUILD_TIMEOUT:-420}
TEST_TIMEOUT=${TEST_TIMEOUT:-300}
SANITIZE_TIMEOUT=${SANITIZE_TIMEOUT:-240}
SANITIZE_TOOLS=${SANITIZE_TOOLS:-"memcheck racecheck"}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-330}
BENCH_ARGS=${BENCH_ARGS:-}
EXTRA_TIMEOUT=${EXTRA_TIMEOUT:-240}
PYTEST_ARGS=${PYTEST_ARGS:-}
PYTEST_WORKERS=${PYTEST_WORKERS:-0}

SCRIPT_ARGS="$*"
ASSUME_BUILT=${ASSUME_BUILT:-0}

# ---------------------------------------------------------------------------------- steps chosen
ORDER=(build ptxas test sanitize bench bench-quick extra)
declare -A WANT=()
if [ $# -eq 0 ]; then set -- build ptxas test bench; fi
for s in "$@"; do
  case "$s" in
    all) for x in build ptxas test sanitize bench extra; do WANT[$x]=1; done ;;
    build|ptxas|test|sanitize|bench|bench-quick|extra) WANT[$s]=1 ;;
    *) echo "gpu_suite: unknown step '$s' (choose from: ${ORDER[*]} all)"; exit 2 ;;
  esac
done

# ------------------------------------------------------------------------------------ bookkeeping
S_NAME=(); S_RC=(); S_SECS=(); S_NOTE=()
SUITE_T0=$SECONDS

record() {  # name rc secs note
  S_NAME+=("$1"); S_RC+=("$2"); S_SECS+=("$3"); S_NOTE+=("$4")
}

summary_table() {
  printf '%-20s %-10s %6s  %s\n' "step" "status" "secs" "note"
  printf '%-20s %-10s %6s  %s\n' "--------------------" "----------" "------" "----"
  local i st
  for i in "${!S_NAME[@]}"; do
    case "${S_RC[$i]}" in
      0) st="ok" ;;
      skip) st="skipped" ;;
      124|137) st="TIMEOUT" ;;
      *) st="FAIL(${S_RC[$i]})" ;;
    esac
    printf '%-20s %-10s %6s  %s\n' "${S_NAME[$i]}" "$st" "${S_SECS[$i]}" "${S_NOTE[$i]}"
  done
}

pack() {  # refresh $OUT after every step, so a killed run still returns what finished
  {
    echo "gpu_suite $(date -u +%Y-%m-%dT%H:%M:%SZ) commit $(git rev-parse HEAD 2>/dev/null)" \
         "dirty=$([ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] && echo yes || echo no)"
    echo "steps requested: ${SCRIPT_ARGS:-default}"
    summary_table
  } > "$OUT/summary.txt" 2>/dev/null
  tar -czf "$OUT/logs.tar.gz.tmp" -C "$WORK" logs bench 2>/dev/null \
    && mv -f "$OUT/logs.tar.gz.tmp" "$OUT/logs.tar.gz"
  local f
  for f in bench_forward.json bench_forward.png bench_forward.txt; do
    [ -f "$BENCH/forward/$f" ] && cp -f "$BENCH/forward/$f" "$OUT/$f"
  done
  return 0
}

run_logged() {  # name timeout_s cmd...   -> tees into $LOGS/name.log, returns the command's rc
  local name=$1 tmo=$2; shift 2
  local log=$LOGS/$name.log
  echo "===== [$name] $(date -u +%H:%M:%S) (timeout ${tmo}s): $*" | tee "$log"
  timeout -k 20 "$tmo" "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  echo "===== [$name] exit $rc" | tee -a "$log"
  return "$rc"
}

src_hash() {
  { git rev-parse HEAD 2>/dev/null
    find csrc setup.py -type f \( -name '*.cu' -o -name '*.h' -o -name '*.cpp' -o -name '*.py' \) \
      -print0 2>/dev/null | sort -z | xargs -0 sha1sum 2>/dev/null
  } | sha1sum | cut -d' ' -f1
}

# ------------------------------------------------------------------------------------ environment
{
  echo "repo: $REPO   OUT: $OUT   WORK: $WORK"
  echo "commit: $(git rev-parse HEAD 2>/dev/null)"
  git status --short 2>/dev/null | head -30
  nvidia-smi 2>&1 | head -25
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit \
    --format=csv 2>&1 | head -5
  command -v nvcc && nvcc --version | tail -2
  python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)' 2>&1
  python3 -c 'import triton; print("triton", triton.__version__)' 2>&1 | tail -1
  python3 -c 'import pytest; print("pytest", pytest.__version__)' 2>&1 | tail -1
  echo "nproc $(nproc)"; free -g 2>/dev/null | head -2
} > "$LOGS/env.log" 2>&1
head -3 "$LOGS/env.log"

BUILD_RC=none   # none: not built in this run
do_build() {
  local t0=$SECONDS rc note
  if [ "$CLEAN_BUILD" = 1 ]; then rm -rf build/temp.* ; fi
  run_logged build "$BUILD_TIMEOUT" env MAX_JOBS="$MAX_JOBS" python3 setup.py build_ext --inplace
  rc=$?
  if [ "$rc" = 0 ]; then
    if python3 -c 'import flash_attention_sm75._C' >>"$LOGS/build.log" 2>&1; then
      src_hash > "$STAMP"
    else
      echo "build finished but flash_attention_sm75._C does not import" | tee -a "$LOGS/build.log"
      rc=3
    fi
  fi
  local spills
  spills=$(grep -ciE 'ptxas warning.*spill|bytes spill (stores|loads)' "$LOGS/build.log" 2>/dev/null)
  note="$(ls flash_attention_sm75/_C*.so 2>/dev/null | head -1); ${spills:-0} ptxas spill warnings"
  [ "$CLEAN_BUILD" = 1 ] && note="clean; $note"
  record build "$rc" $((SECONDS - t0)) "$note"
  BUILD_RC=$rc
  pack
}

need_ext() {  # make sure the extension matching these sources is built; 0 if usable
  if [ "$BUILD_RC" = none ]; then
    if [ "$ASSUME_BUILT" = 1 ] && python3 -c 'import flash_attention_sm75._C' >/dev/null 2>&1; then
      return 0
    fi
    if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$(src_hash)" ] \
       && python3 -c 'import flash_attention_sm75._C' >/dev/null 2>&1; then
      return 0
    fi
    echo "gpu_suite: extension not built for these sources on this machine; building first"
    do_build
  fi
  [ "$BUILD_RC" = 0 ]
}

do_ptxas() {
  local t0=$SECONDS
  if [ ! -f scripts/check_sm75.py ]; then
    record ptxas skip 0 "scripts/check_sm75.py not present"; return
  fi
  run_logged ptxas 300 python3 scripts/check_sm75.py --json "$OUT/ptxas.json"
  local rc=$?
  record ptxas "$rc" $((SECONDS - t0)) "$(tail -1 "$LOGS/ptxas.log" | cut -c1-120)"
  pack
}

do_test() {
  local t0=$SECONDS
  if ! need_ext; then record test skip 0 "extension not built"; return; fi
  # PYTEST_WORKERS=N: pytest-xdist with N processes on the one GPU. The GPU machine has no
  # xdist; wheels in .whl/ (pip download --no-deps -d .whl pytest-xdist execnet; carry ".whl")
  # are installed into a scratch folder. Verbose, so that a run the window cuts short still
  # names every failure so far (a quiet run names them only at the end).
  local mode=(-q)
  if [ "$PYTEST_WORKERS" != 0 ]; then
    if ! python3 -c "import xdist" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
      python3 -m pip install -q --no-deps --target /tmp/gpu_suite_xdist .whl/*.whl \
        && export PYTHONPATH="/tmp/gpu_suite_xdist${PYTHONPATH:+:$PYTHONPATH}"
    fi
    if python3 -c "import xdist" 2>/dev/null; then
      mode=(-v -n "$PYTEST_WORKERS")
    else
      echo "gpu_suite: PYTEST_WORKERS=$PYTEST_WORKERS but pytest-xdist is not importable; serial run"
    fi
  fi
  local paths=(tests)
  if [ -n "${TEST_PART:-}" ]; then
    local listing
    if ! listing=$(test_paths "$TEST_PART") || [ -z "$listing" ]; then
      record test 2 0 "bad TEST_PART '$TEST_PART' (choose from: A1 A2 B C D E)"; pack; return
    fi
    mapfile -t paths <<< "$listing"
  fi
  # shellcheck disable=SC2086
  run_logged test "$TEST_TIMEOUT" python3 -m pytest "${mode[@]}" -p no:cacheprovider -rfEs \
    --durations=10 --junitxml="$OUT/junit.xml" $PYTEST_ARGS "${paths[@]}"
  local rc=$?
  local line
  line=$(grep -E '(passed|failed|error|no tests ran|skipped|deselected)' "$LOGS/test.log" \
         | grep -vE '^(FAILED|ERROR|SKIPPED)' | tail -1 | sed 's/=//g; s/^ *//')
  record test "$rc" $((SECONDS - t0)) "$line"
  pack
}

# The test files of TEST_PART's groups. A1: the dense kernels; A2: bias, score modifiers,
# dropout; B: the SDPA wrapper and override, integrations, examples; C: KV cache, ops, varlen,
# rules, drop-in; D: benchmarks; E: every other tests/test_*.py (CPU-only files).
test_paths() {
  local part f listed=" "
  declare -A G=(
    [A1]="test_flash_attn test_backward test_head_dims test_window test_varlen_kernels"
    [A2]="test_attn_bias test_scoremod test_dropout"
    [B]="test_sdpa test_sdpa_override test_flash_attn_dropin_gpu test_memeff_sm75_baseline test_zero_size test_validation test_transformers_gpu test_transformers_empty_rows test_transformers test_diffusers test_examples"
    [C]="test_kvcache_gpu test_kvcache test_ops test_varlen test_rules test_flash_attn_dropin"
    [D]="test_benchmarks"
  )
  for part in "${!G[@]}"; do listed+="${G[$part]} "; done
  for part in $1; do
    case "$part" in
      A1|A2|B|C|D) for f in ${G[$part]}; do echo "tests/$f.py"; done ;;
      E) for f in tests/test_*.py; do
           f=${f#tests/}; f=${f%.py}
           [[ "$listed" == *" $f "* ]] || echo "tests/$f.py"
         done ;;
      *) echo "gpu_suite: unknown TEST_PART '$part' (choose from: A1 A2 B C D E)" >&2; return 2 ;;
    esac
  done
}

find_sanitizer() {
  local c
  for c in "$(command -v compute-sanitizer 2>/dev/null)" \
           "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer" \
           "${CUDA_HOME:-/usr/local/cuda}/compute-sanitizer/compute-sanitizer" \
           /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer; do
    if [ -n "$c" ] && [ -x "$c" ]; then echo "$c"; return 0; fi
  done
  return 1
}

do_sanitize() {
  local t0=$SECONDS san tool rc note
  if ! need_ext; then record sanitize skip 0 "extension not built"; return; fi
  if ! san=$(find_sanitizer); then
    record sanitize 127 0 "compute-sanitizer not found"; pack; return
  fi
  # Instrument only our kernels when this sanitizer supports a kernel filter (much faster).
  local filt=()
  if "$san" --kernel-name kns=flash_ --tool memcheck /bin/true >/dev/null 2>&1; then
    filt=(--kernel-name kns=flash_)
  fi
  for tool in $SANITIZE_TOOLS; do
    t0=$SECONDS
    run_logged "sanitize-$tool" "$SANITIZE_TIMEOUT" env PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
      "$san" --tool "$tool" --error-exitcode 86 --print-limit 40 ${filt[@]+"${filt[@]}"} \
      python3 scripts/sanitize_driver.py
    rc=$?
    local log=$LOGS/sanitize-$tool.log
    local summ drv
    summ=$(grep -E '(ERROR SUMMARY|RACECHECK SUMMARY|SYNCCHECK SUMMARY|INITCHECK SUMMARY)' "$log" \
           | tail -1 | sed 's/^=* *//')
    drv=$(grep -E '^SANITIZE_DRIVER' "$log" | tail -1 | sed 's/SANITIZE_DRIVER //')
    note="${summ:-no sanitizer summary line}; ${drv:-driver did not finish}"
    [ ${#filt[@]} -gt 0 ] && note="$note; kernels: flash_* only"
    # A zero exit without the summary line means the tool did not really check anything.
    if [ "$rc" = 0 ] && [ -z "$summ" ]; then rc=87; fi
    record "sanitize-$tool" "$rc" $((SECONDS - t0)) "$note"
    pack
  done
}

bench_note() {  # headline numbers from the forward benchmark JSON
  python3 - "$1" <<'PY' 2>/dev/null || echo "no JSON"
import json, math, sys
r = json.load(open(sys.argv[1]))
ceil = (r.get("sm75_ceiling") or {}).get("peak_tflops")
ours = [c["backends"].get("ours", {}).get("tflops") for c in r["cases"]]
ours = [x for x in ours if x]
rat = [c.get("ratio_ours_vs_efficient") for c in r["cases"] if c.get("ratio_ours_vs_efficient")]
gm = math.exp(sum(map(math.log, rat)) / len(rat)) if rat else None
parts = [f"ceiling {ceil:.0f} TF" if ceil else "ceiling -"]
if ours:
    parts.append(f"ours max {max(ours):.0f} TF" + (f" ({100 * max(ours) / ceil:.0f}% ceil)" if ceil else ""))
if rat:
    parts.append(f"t_eff/t_ours geomean {gm:.2f}x [{min(rat):.2f}, {max(rat):.2f}]")
parts.append(f"{len(ours)}/{len(r['cases'])} cases ran ours")
print("; ".join(parts))
PY
}

do_bench() {  # mode: full | quick
  local mode=$1 t0=$SECONDS name rc args
  name=$([ "$mode" = quick ] && echo bench-quick || echo bench)
  if ! need_ext; then record "$name" skip 0 "extension not built"; return; fi
  if [ "$mode" = quick ]; then args=(--quick --decode); else args=(--decode); fi
  # shellcheck disable=SC2086
  run_logged "$name" "$BENCH_TIMEOUT" python3 benchmarks/bench_forward.py \
    --out-dir "$BENCH/forward" --cache-dir "$CACHE" ${args[@]+"${args[@]}"} $BENCH_ARGS
  rc=$?
  record "$name" "$rc" $((SECONDS - t0)) "$(bench_note "$BENCH/forward/bench_forward.json")"
  pack
}

do_extra() {
  local any=0 f name t0 rc args
  if ! need_ext; then record extra skip 0 "extension not built"; return; fi
  for f in benchmarks/bench_e2e_hf.py benchmarks/bench_backward.py; do
    [ -f "$f" ] || continue
    any=1; t0=$SECONDS
    name=$(basename "$f" .py)
    args=()
    [ "$name" = bench_e2e_hf ] && args+=(--quick)
    grep -q -- '--out-dir' "$f" && args+=(--out-dir "$BENCH/$name")
    grep -q -- '--cache-dir' "$f" && args+=(--cache-dir "$CACHE")
    run_logged "$name" "$EXTRA_TIMEOUT" python3 "$f" ${args[@]+"${args[@]}"}
    rc=$?
    record "$name" "$rc" $((SECONDS - t0)) "$(grep -v '^=====' "$LOGS/$name.log" | tail -1 | cut -c1-120)"
    pack
  done
  [ "$any" = 1 ] || record extra skip 0 "no bench_e2e_hf.py / bench_backward.py yet"
}

# ---------------------------------------------------------------------------------------- run
for s in "${ORDER[@]}"; do
  [ -n "${WANT[$s]:-}" ] || continue
  case "$s" in
    build) do_build ;;
    ptxas) do_ptxas ;;
    test) do_test ;;
    sanitize) do_sanitize ;;
    bench) do_bench full ;;
    bench-quick) do_bench quick ;;
    extra) do_extra ;;
  esac
done
pack "$@"

# ------------------------------------------------------------------- digest (printed last)
echo
echo "################################ gpu_suite digest ################################"
if [ -f "$LOGS/test.log" ]; then
  echo "--- pytest (failures / summary) ---"
  grep -E '^(FAILED|ERROR) | (FAILED|ERROR) tests/|[0-9]+ (passed|failed)|no tests ran|^E  ' "$LOGS/test.log" \
    | cut -c1-200 | tail -15
fi
for f in "$LOGS"/sanitize-*.log; do
  [ -f "$f" ] || continue
  echo "--- $(basename "$f" .log) ---"
  grep -E '(ERROR SUMMARY|RACECHECK SUMMARY|SYNCCHECK SUMMARY|^SANITIZE_DRIVER|  failed:|^FAIL|Invalid|Race reported|Hazard)' "$f" \
    | cut -c1-180 | head -8
done
f=$BENCH/forward/bench_forward.txt
if [ -f "$f" ]; then
  echo "--- bench_forward (full tables: $OUT/bench_forward.txt) ---"
  grep -E '^(SM75-instruction ceiling|ours:)' "$f"
  # the speed table and the decode table; the memory table is in the txt/JSON
  awk '/^== forward/{p=1} /^== peak extra memory/{p=0} /^== decode/{p=1} /^== backends/{p=0} /^wrote /{p=0} p' "$f" \
    | cut -c1-220
fi
echo "--- steps (total $((SECONDS - SUITE_T0)) s; outputs in $OUT: $(ls "$OUT" | tr '\n' ' ')) ---"
summary_table
FAILED=0
for rc in "${S_RC[@]}"; do
  case "$rc" in 0|skip) ;; *) FAILED=1 ;; esac
done
rm -rf "$WORK"
exit $FAILED
