#!/usr/bin/env bash
# ASan + UBSan over the CPU test suite, for one Python version; with
# SAN=thread, ThreadSanitizer instead.
#
#   benchmarks/sanitize.sh 3.11                  # the whole suite
#   benchmarks/sanitize.sh 3.12 tests/unit/test_capture.py -k thread
#   SAN=thread benchmarks/sanitize.sh 3.11 tests/unit/test_capture_queue.py
#
# Builds memviz._core and the libcupti test double with
# -fsanitize=address,undefined in a copy of this working tree (so the
# tree's own plain build is left alone), then runs pytest there with libasan
# preloaded (the interpreter itself is not instrumented, so the ASan runtime
# must come first) and halt_on_error=1 for both sanitizers: the first report
# fails the run. Leaks are not checked (CPython keeps memory until exit).
#
# The Python comes from /root/.pyenv/versions/PYVER.*, else pythonPYVER on
# PATH; its tests run in a venv under /tmp (memviz-san-venvPYVER) made on the
# first use with pytest and setuptools. Set SAN_PIP="torch==2.13.0 numpy ..."
# to install more into that venv (the suite skips what it cannot import);
# SAN_PYTHON=/path/to/python uses that interpreter as is, no venv.
#
# SAN=thread: memviz._core and the test double built with -fsanitize=thread,
# libtsan preloaded, the address space's randomisation off for the run where
# the kernel allows it (setarch -R: TSan wants its fixed shadow ranges free),
# data races only, every report of the run kept, benchmarks/tsan.supp's
# suppressions (other libraries' own objects only). Only memviz's C is
# instrumented: CPython's GIL, libc's and the test double's locks are seen
# through TSan's interceptors, the interpreter's own memory accesses not at
# all. A test that times threads against each other (the drainer's wake-ups,
# a storm that must overrun it) or bounds resident memory (TSan's shadow
# adds to it) may fail without any report: read the reports, not only the
# exit status. tests/integration forks children that start threads: give it
# TSAN_OPTIONS=die_after_fork=0 (added to the options here).
set -euo pipefail
ver=${1:?usage: benchmarks/sanitize.sh PYVER [pytest arguments]}
shift
root=$(cd "$(dirname "$0")/.." && pwd)

if [ -n "${SAN_PYTHON:-}" ]; then
  py=$SAN_PYTHON
else
  base=$(ls -d /root/.pyenv/versions/"$ver".*/bin/python 2>/dev/null | head -1 || true)
  [ -n "$base" ] || base=$(command -v "python$ver" || true)
  [ -n "$base" ] || { echo "sanitize.sh: no Python $ver found" >&2; exit 2; }
  venv=/tmp/memviz-san-venv$ver
  if [ ! -x "$venv/bin/python" ]; then
    "$base" -m venv "$venv"
    "$venv/bin/pip" install -q "setuptools>=77" pytest
  fi
  [ -z "${SAN_PIP:-}" ] || "$venv/bin/pip" install -q $SAN_PIP
  py=$venv/bin/python
fi

san=${SAN:-address}
case "$san" in
  address) flags="-fsanitize=address,undefined -fno-omit-frame-pointer"; rt=libasan.so
           build_flag=--memviz-sanitize ;;
  thread)  flags="-fsanitize=thread -fno-omit-frame-pointer"; rt=libtsan.so
           build_flag=--memviz-sanitize-thread ;;
  *) echo "sanitize.sh: SAN=$san: give address (the default: ASan + UBSan) or thread" >&2; exit 2 ;;
esac
runtime=$(gcc -print-file-name=$rt)
[ -e "$runtime" ] || { echo "sanitize.sh: $rt not found (gcc -print-file-name)" >&2; exit 2; }
runtime=$(readlink -f "$runtime")
# libstdc++ too: ASan intercepts __cxa_throw only in a C++ runtime present when it
# starts (torch's C++ exceptions otherwise stop the run with "CHECK failed").
stdcxx=$(readlink -f "$(gcc -print-file-name=libstdc++.so)")

# The copy: tracked and untracked-but-not-ignored files, as the tree is now.
work=/tmp/memviz-san-src$ver${SAN:+-$san}
rm -rf "$work" && mkdir -p "$work"
(cd "$root" && git ls-files -z --cached --others --exclude-standard |
   while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done |
   tar --null -T - -cf -) | tar -xf - -C "$work"
cd "$work"
LDFLAGS="${flags%% *}" "$py" setup.py -q build_ext --inplace $build_flag \
  > build.log 2>&1 || { cat build.log >&2; exit 2; }

export CFLAGS_EXTRA="$flags"            # the test double, built by the suite (tests/fake_cupti)
# Reports go to files (pytest's capture of stderr dies with a halted process),
# one per process, subprocesses of the tests included; shown at the end.
logs=$work/sanitizer-reports
mkdir -p "$logs"
norand=""
if [ "$san" = thread ]; then
  # every report of a run at once (a race leaves nothing corrupt to run on, unlike ASan's
  # findings); a process that reported exits 66, which fails the test that ran it. Data races
  # only: lock order is tests/unit/test_c_layers.py's (the lock table), and TSan's own
  # detector stops the process where a library's fork handler holds over 64 locks (duckdb's)
  export TSAN_OPTIONS="halt_on_error=0:report_signal_unsafe=0:detect_deadlocks=0:suppressions=$root/benchmarks/tsan.supp:log_path=$logs/tsan${TSAN_OPTIONS:+:$TSAN_OPTIONS}"
  # where the kernel lets it (a container's seccomp filter may not): TSan usually copes anyway
  ! setarch "$(uname -m)" -R true 2> /dev/null || norand="setarch $(uname -m) -R"
else
  export ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=0:detect_odr_violation=0:log_path=$logs/asan${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
  export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:log_path=$logs/ubsan${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"
  export PYTHONMALLOC=malloc               # every Python object through malloc: ASan sees their frees
fi
echo "sanitize.sh: Python $("$py" -c 'import sys; print(sys.version.split()[0])'), $runtime, in $work"
rc=0
LD_PRELOAD="$runtime $stdcxx" PYTHONPATH="$work" $norand "$py" -m pytest -q -p no:cacheprovider "$@" || rc=$?
reports=$(ls "$logs")
if [ -n "$reports" ]; then
  for f in "$logs"/*; do echo "==== sanitizer report $f"; cat "$f"; done
  echo "sanitize.sh: $(echo "$reports" | wc -l) sanitizer report(s), above" >&2
  [ "$rc" -ne 0 ] || rc=1
else
  echo "sanitize.sh: no sanitizer reports"
fi
exit "$rc"
