#!/usr/bin/env bash
# Build the collector's C walk with AddressSanitizer + UBSan + libFuzzer coverage (clang) and fuzz it
# against protobuf's parser for FUZZ_SECONDS (default 60), starting from the corpus kept in the
# repository (tests/fuzz/corpus). New inputs go to a scratch directory; `run.sh --merge` folds the
# interesting ones back into the kept corpus. Exit status: 0 when nothing was found.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
SECONDS_=${FUZZ_SECONDS:-60}
command -v clang >/dev/null || { echo "run.sh: clang is needed (apt-get install clang; make fuzz installs it)" >&2; exit 2; }
BUILD=build/fuzz
mkdir -p "$BUILD"
INC=$($PY -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
EXT="$BUILD/_otlp_walk_fuzz$($PY -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
# compiled instrumented, linked without the sanitizer runtimes: atheris' preloaded one provides them
clang -c -fPIC -O1 -g -fno-omit-frame-pointer \
  -fsanitize=address,undefined,fuzzer-no-link -fno-sanitize-recover=undefined \
  -I"$INC" collector/receivers/_otlp_walk.c -o "$BUILD/_otlp_walk.o"
clang -shared "$BUILD/_otlp_walk.o" -o "$EXT"
ATHERIS=$($PY -c 'import atheris, os; print(atheris.path())')
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export OTEL_LLM_FUZZ_EXT="$EXT"
export ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1:abort_on_error=0
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
export LD_PRELOAD="$ATHERIS/asan_with_fuzzer.so"
if [ "${1:-}" = "--merge" ]; then
  mkdir -p "$WORK/new"
  $PY tests/fuzz/fuzz_walk.py -max_total_time="$SECONDS_" -rss_limit_mb=4096 -max_len=16384 "$WORK/new" tests/fuzz/corpus
  $PY tests/fuzz/fuzz_walk.py -merge=1 tests/fuzz/corpus "$WORK/new"
else
  $PY tests/fuzz/fuzz_walk.py -max_total_time="$SECONDS_" -rss_limit_mb=4096 -max_len=16384 \
    -artifact_prefix="$WORK/" -print_final_stats=1 "$WORK" tests/fuzz/corpus || {
      rc=$?; mkdir -p build/fuzz/crashes; cp "$WORK"/crash-* build/fuzz/crashes/ 2>/dev/null || true
      echo "run.sh: the fuzzer found an input (kept in build/fuzz/crashes)" >&2; exit $rc; }
fi
