#!/usr/bin/env bash
# ASan + UBSan over the CPU test suite, for one Python version.
#
#   benchmarks/sanitize.sh 3.11                  # the whole suite
#   benchmarks/sanitize.sh 3.12 tests/unit/test_capture.py -k thread
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

flags="-fsanitize=address,undefined -fno-omit-frame-pointer"
asan=$(gcc -print-file-name=libasan.so)
[ -e "$asan" ] || { echo "sanitize.sh: libasan not found (gcc -print-file-name)" >&2; exit 2; }
asan=$(readlink -f "$asan")
# libstdc++ too: ASan intercepts __cxa_throw only in a C++ runtime present when it
# starts (torch's C++ exceptions otherwise stop the run with "CHECK failed").
stdcxx=$(readlink -f "$(gcc -print-file-name=libstdc++.so)")

# The copy: tracked and untracked-but-not-ignored files, as the tree is now.
work=/tmp/memviz-san-src$ver
rm -rf "$work" && mkdir -p "$work"
(cd "$root" && git ls-files -z --cached --others --exclude-standard |
   while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done |
   tar --null -T - -cf -) | tar -xf - -C "$work"
cd "$work"
LDFLAGS="-fsanitize=address,undefined" "$py" setup.py -q build_ext --inplace --memviz-sanitize \
  > build.log 2>&1 || { cat build.log >&2; exit 2; }

export CFLAGS_EXTRA="$flags"            # the test double, built by the suite (tests/fake_cupti)
# Reports go to files (pytest's capture of stderr dies with a halted process),
# one per process, subprocesses of the tests included; shown at the end.
logs=$work/sanitizer-reports
mkdir -p "$logs"
export ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=0:detect_odr_violation=0:log_path=$logs/asan${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:log_path=$logs/ubsan${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"
export PYTHONMALLOC=malloc                 # every Python object through malloc: ASan sees their frees
echo "sanitize.sh: Python $("$py" -c 'import sys; print(sys.version.split()[0])'), $asan, in $work"
rc=0
LD_PRELOAD="$asan $stdcxx" PYTHONPATH="$work" "$py" -m pytest -q -p no:cacheprovider "$@" || rc=$?
reports=$(ls "$logs")
if [ -n "$reports" ]; then
  for f in "$logs"/*; do echo "==== sanitizer report $f"; cat "$f"; done
  echo "sanitize.sh: $(echo "$reports" | wc -l) sanitizer report(s), above" >&2
  [ "$rc" -ne 0 ] || rc=1
else
  echo "sanitize.sh: no sanitizer reports"
fi
exit "$rc"
