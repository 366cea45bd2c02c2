#!/usr/bin/env bash
# The project's test command (README and .ci/run use exactly this):
#
#     bash scripts/test.sh
#
# Needs python3 + pip, a CUDA toolkit (nvcc) and a C++ compiler; no GPU. It
#   1. installs torch==2.11.0 (if another version is present), the build tools and the package
#      with its test extras: pip install -e '.[test]' --no-build-isolation (MAX_JOBS=2);
#   2. runs scripts/check_sm75.py (sm_75 registers/spills/smem + generate_kernels.py --check);
#   3. runs python -m pytest -q tests (no tests collected, or none passed, is a failure);
#   4. configures, builds and runs the LibTorch/GoogleTest suite with CMake + CTest (zero tests,
#      or none passed, is a failure);
#   5. newest torch: a venv (build/newest-torch) with the newest torch on PyPI, the package built
#      and installed there as a user would (pip install --no-build-isolation .), then the CPU
#      test suite and the sm_75 ptxas check run with it (the supported range has no upper bound);
# and prints one summary line. GPU tests skip themselves when no GPU is visible.
#
# Knobs: PYTHON (default python3), MAX_JOBS (default 2), TORCH_INDEX_URL (index for torch),
#        BUILD_DIR (CMake build dir, default build/cmake), SKIP_INSTALL=1 (use what is installed),
#        SKIP_NEWEST_TORCH=1 (skip step 5), NEWEST_TORCH_VERSION (step 5's torch; default: the
#        newest on the index), KEEP_NEWEST_TORCH=1 (keep step 5's venv), NEWEST_TORCH_MIN_FREE_GB
#        (free disk step 5 needs to start; default 8).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
export MAX_JOBS=${MAX_JOBS:-2}
export NVCC_THREADS=${NVCC_THREADS:-1}
BUILD_DIR=${BUILD_DIR:-build/cmake}
RESULTS=build/test-results
TORCH_VERSION=2.11.0
mkdir -p "$RESULTS"

T0=$SECONDS
declare -a SUMMARY=()
FAILED=0

log() { printf '\n==== [%s +%ds] %s\n' "$(date +%H:%M:%S)" "$((SECONDS - T0))" "$*"; }
fail() {
  FAILED=1
  SUMMARY+=("$1 FAILED")
  printf '\n!!!! %s FAILED\n' "$1" >&2
}
finish() {
  FINISHED=1
  local t=$((SECONDS - T0))
  local status=PASSED
  [ "$FAILED" -eq 0 ] || status=FAILED
  local joined
  joined=$(printf '%s; ' "${SUMMARY[@]}")
  printf '\nTEST SUMMARY: %s in %dm%02ds: %s\n' "$status" $((t / 60)) $((t % 60)) "${joined%; }"
  [ "$FAILED" -eq 0 ]
}

# A step that aborts the script (set -e: install, environment) still gets a summary line.
on_exit() {
  local rc=$?
  if [ -z "${FINISHED:-}" ]; then
    printf '\nTEST SUMMARY: FAILED (aborted with exit %d after %ds; see the log above)\n' \
      "$rc" $((SECONDS - T0)) >&2
  fi
}
trap on_exit EXIT

# ---- CUDA toolkit ------------------------------------------------------------------------------
if ! command -v nvcc >/dev/null 2>&1; then
  for d in "${CUDA_HOME:-}" /usr/local/cuda; do
    if [ -n "$d" ] && [ -x "$d/bin/nvcc" ]; then export PATH="$d/bin:$PATH"; break; fi
  done
fi
command -v nvcc >/dev/null 2>&1 || { echo "scripts/test.sh: nvcc not found (set CUDA_HOME)" >&2; exit 1; }
export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}

# ---- 1. Python environment ----------------------------------------------------------------------
# A distro python that refuses pip installs (PEP 668) gets a venv that still sees its packages.
if [ -z "${VIRTUAL_ENV:-}" ] && "$PY" - <<'EOF'
import os, sys, sysconfig
sys.exit(0 if sys.prefix == sys.base_prefix and os.path.exists(
    os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")) else 1)
EOF
then
  log "externally managed python: using venv .venv (--system-site-packages)"
  [ -x .venv/bin/python ] || "$PY" -m venv --system-site-packages .venv
  PY=$ROOT/.venv/bin/python
fi
PIP=("$PY" -m pip)

if [ "${SKIP_INSTALL:-0}" != 1 ]; then
  log "install: torch==$TORCH_VERSION, build tools, pip install -e '.[test]' (MAX_JOBS=$MAX_JOBS)"
  if ! "$PY" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" \
      2>/dev/null; then
    if [ -n "${TORCH_INDEX_URL:-}" ]; then
      "${PIP[@]}" install "torch==$TORCH_VERSION" --index-url "$TORCH_INDEX_URL"
    else
      "${PIP[@]}" install "torch==$TORCH_VERSION"
    fi
  fi
  "${PIP[@]}" install "setuptools>=64" wheel ninja
  # CMake >= 3.22 for the C++ suite; the PyPI wheel when the system has none or an older one.
  if ! cmake --version 2>/dev/null | "$PY" -c "
import re, sys
m = re.search(r'(\d+)\.(\d+)', sys.stdin.read())
sys.exit(0 if m and (int(m.group(1)), int(m.group(2))) >= (3, 22) else 1)"; then
    "${PIP[@]}" install "cmake>=3.22"
  fi
  "${PIP[@]}" install -e '.[test]' --no-build-isolation
  SUMMARY+=("install OK")
else
  SUMMARY+=("install skipped")
fi
# Tools pip put next to the interpreter (cmake, ninja) come first.
PATH="$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))'):$PATH"
export PATH
"$PY" -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, \
'GPU available:', torch.cuda.is_available())"

# ---- 2. sm_75 resource check ------------------------------------------------------------------
log "scripts/check_sm75.py"
if "$PY" scripts/check_sm75.py --jobs "$MAX_JOBS" --json "$RESULTS/check_sm75.json"; then
  n=$("$PY" -c "import json; d=json.load(open('$RESULTS/check_sm75.json')); \
print(sum(k['entry'] for k in d['kernels']))")
  SUMMARY+=("check_sm75 OK ($n kernels)")
else
  fail "check_sm75"
fi

# ---- 3. pytest --------------------------------------------------------------------------------
# Counts come from the JUnit XML: "no tests collected" (exit 5) or zero passed tests fail.
count_junit() {  # file -> "tests failures errors skipped passed"
  "$PY" - "$1" <<'EOF'
import sys, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
t = {k: sum(int(s.get(k, 0) or 0) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
skipped = t["skipped"]
if not skipped:  # ctest writes <skipped/> children but may leave the attribute out
    skipped = sum(1 for s in suites for c in s.iter("testcase")
                  if c.find("skipped") is not None or c.get("status") in ("notrun", "disabled"))
passed = t["tests"] - t["failures"] - t["errors"] - skipped
print(t["tests"], t["failures"], t["errors"], skipped, passed)
EOF
}

# judge_junit NAME EXIT_CODE REPORT: fails on a missing report, a non-zero exit, or nothing passed.
judge_junit() {
  local name=$1 rc=$2 report=$3 total failures errors skipped passed
  if [ ! -f "$report" ]; then
    fail "$name (exit $rc, no report)"
    return
  fi
  read -r total failures errors skipped passed < <(count_junit "$report")
  if [ "$rc" -ne 0 ]; then
    fail "$name (exit $rc: $failures failed, $errors errors, $passed passed)"
  elif [ "$passed" -le 0 ]; then
    fail "$name (0 passed of $total)"
  else
    SUMMARY+=("$name OK ($passed passed, $skipped skipped)")
  fi
}

log "python -m pytest -q tests"
rc=0
"$PY" -m pytest -q tests --junitxml="$RESULTS/pytest.xml" || rc=$?
if [ "$rc" -eq 5 ]; then
  fail "pytest (no tests collected)"
else
  judge_junit pytest "$rc" "$RESULTS/pytest.xml"
fi

# ---- 4. CMake + CTest (LibTorch library, GoogleTest) ------------------------------------------
log "cmake configure + build ($BUILD_DIR) + ctest"
generator=()
command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)
if [ -f "$BUILD_DIR/CMakeCache.txt" ] && ! grep -q "CMAKE_HOME_DIRECTORY:INTERNAL=$ROOT\$" \
    "$BUILD_DIR/CMakeCache.txt"; then
  rm -rf "$BUILD_DIR"  # a cache from another checkout
fi
if ! cmake -S . -B "$BUILD_DIR" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DPython3_EXECUTABLE="$PY" -DFLASH_SM75_BUILD_TESTS=ON; then
  fail "cmake configure"
elif ! cmake --build "$BUILD_DIR" --parallel "$MAX_JOBS"; then
  fail "cmake build"
else
  rc=0
  ctest --test-dir "$BUILD_DIR" --output-on-failure --no-tests=error -j "$MAX_JOBS" \
    --output-junit "$ROOT/$RESULTS/ctest.xml" || rc=$?
  judge_junit ctest "$rc" "$RESULTS/ctest.xml"
fi

# ---- 5. newest torch on PyPI --------------------------------------------------------------------
# pyproject.toml says torch >= 2.6 with no upper bound, so the newest release must build and pass.
# Its own venv (the main environment keeps its torch), seeing the main environment's packages
# (pytest, transformers, ...) after its own through a .pth file. The package is built from a
# copy of the tree and installed non-editable, as `pip install --no-build-isolation .` does for
# a user; the copy's package folder is then removed so that the tests import the installed one.
# The venv takes about 5.5 GB (torch, triton and the nvidia-* CUDA wheels): pip keeps no cache of
# those wheels (a second copy), and the venv and the source copy are removed when the step ends
# (KEEP_NEWEST_TORCH=1 keeps them). With less free disk than NEWEST_TORCH_MIN_FREE_GB (default 8)
# the step is not started and the summary says so: a half-installed torch ends in "No space left
# on device" and tells nothing about the package.
newest_torch() {
  local dir=$ROOT/build/newest-torch
  local venv=$dir/venv src=$dir/src py=$dir/venv/bin/python version rc free_gb
  local need_gb=${NEWEST_TORCH_MIN_FREE_GB:-8}
  mkdir -p "$dir"
  free_gb=$(df -Pk "$dir" | awk 'NR == 2 {printf "%d", $4 / 1048576}')
  if [ ! -x "$py" ] && [ "${free_gb:-0}" -lt "$need_gb" ]; then
    log "newest torch: not run, ${free_gb} GB free under $dir and the venv needs about $need_gb"
    SUMMARY+=("newest-torch NOT RUN (${free_gb} GB free, needs ${need_gb}; NEWEST_TORCH_MIN_FREE_GB)")
    return
  fi
  log "newest torch: venv $venv (${free_gb} GB free)"
  if [ ! -x "$py" ]; then
    "$PY" -m venv "$venv" || { fail "newest-torch (venv)"; return; }
  fi
  "$PY" -c 'import sys; print("\n".join(p for p in sys.path if p.endswith(("site-packages", "dist-packages"))))' \
    > "$("$py" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/_flash_sm75_main_env.pth"
  local index=()
  [ -z "${TORCH_INDEX_URL:-}" ] || index=(--index-url "$TORCH_INDEX_URL")
  if ! PIP_NO_CACHE_DIR=1 "$py" -m pip install -q --upgrade "${index[@]}" \
      "torch${NEWEST_TORCH_VERSION:+==$NEWEST_TORCH_VERSION}"; then
    fail "newest-torch (pip install torch)"; return
  fi
  PIP_NO_CACHE_DIR=1 "$py" -m pip install -q --upgrade "setuptools>=64" wheel ninja || { fail "newest-torch (build tools)"; return; }
  version=$("$py" -c 'import torch; print(torch.__version__)')
  log "newest torch: torch $version (CUDA $("$py" -c 'import torch; print(torch.version.cuda)')); pip install --no-build-isolation . (MAX_JOBS=$MAX_JOBS)"
  rm -rf "$src" && mkdir -p "$src"
  if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    git ls-files -z -co --exclude-standard | tar --null -T - -cf - | tar -xf - -C "$src"
  else
    tar --exclude=./build --exclude=./.venv --exclude=./.git --exclude='*.so' -cf - . | tar -xf - -C "$src"
  fi
  local build_log=$RESULTS/newest-torch-build.log
  if ! (cd "$src" && PIP_NO_CACHE_DIR=1 "$py" -m pip install -v --no-build-isolation "$src") > "$build_log" 2>&1; then
    grep -E "error|Error" "$build_log" | head -n 30
    tail -n 15 "$build_log"
    fail "newest-torch $version (build; log: $build_log)"; return
  fi
  grep -E "^ *\[[0-9]+/[0-9]+\]|Successfully installed" "$build_log" | sed 's/ -.*//' | tail -n 3
  rm -rf "$src/flash_attention_sm75"
  if ! (cd "$src" && "$py" -c 'import flash_attention_sm75 as fa, torch, sys
print("flash_attention_sm75", fa.__version__, "from", fa.__file__, "extension:", fa.EXTENSION_AVAILABLE)
sys.exit(0 if fa.EXTENSION_AVAILABLE and "site-packages" in fa.__file__ else 1)'); then
    fail "newest-torch $version (import)"; return
  fi
  log "newest torch: scripts/check_sm75.py"
  if "$py" "$src/scripts/check_sm75.py" --jobs "$MAX_JOBS" --json "$RESULTS/newest-torch-check_sm75.json"; then
    SUMMARY+=("newest-torch check_sm75 OK")
  else
    fail "newest-torch check_sm75"
  fi
  # tests/test_emu_kernels.py runs the kernels on a CPU emulator without torch: step 3 ran it.
  log "newest torch: python -m pytest -q tests (torch $version; not test_emu_kernels.py)"
  rc=0
  (cd "$src" && "$py" -m pytest -q tests -p no:cacheprovider --ignore=tests/test_emu_kernels.py \
    --junitxml="$ROOT/$RESULTS/newest-torch-pytest.xml") || rc=$?
  judge_junit "newest-torch $version pytest" "$rc" "$RESULTS/newest-torch-pytest.xml"
}

if [[ "${SKIP_NEWEST_TORCH:-0}" =~ ^(1|true|yes|on)$ ]]; then
  SUMMARY+=("newest-torch skipped (SKIP_NEWEST_TORCH=1)")
else
  newest_torch
  if [[ ! "${KEEP_NEWEST_TORCH:-0}" =~ ^(1|true|yes|on)$ ]]; then
    rm -rf "$ROOT/build/newest-torch/venv" "$ROOT/build/newest-torch/src"
  fi
fi

finish
