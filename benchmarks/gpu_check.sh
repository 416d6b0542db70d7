#!/usr/bin/env bash
# One device call: build, CPU suite on the GPU machine's Python, GPU suite,
# the demo, and (with BENCH=1) the GPU benchmarks; COST=1: issue 27's paired cost runs
# (both steps, five configurations; COST_CONFIGS may add memviz_noop, the route with its capture
# path returning at once, and bench_train_step.py's ABLATIONS) and the C capture cost; LAUNCH=1: a kernel launch's
# cost under memviz, with and without CUPTI (bench_launch.py); IN_STEP=1 (IN_STEP_AGAINST=DIR):
# memviz's own share of the allocation-bound step (bench_in_step.py); STAGES=1: the same on a
# stage build, ns per stage; TOGGLE=1 (TOGGLE_MODES, TOGGLE_AGAINST=DIR: two builds alternating): settings switched every
# step in one tracked run (bench_toggle.py); ABLATE=1: the same on an ablation build, pieces of the
# capture path left out. Results land in $OUT.
# Usage on the GPU machine:  bash benchmarks/gpu_check.sh [quick|full]
set -u
OUT=${OUT:-/tmp/memviz-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
{
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  $PY -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda)'
} > "$OUT/machine.txt" 2>&1

$PY setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
grep -E "warning|error" "$OUT/build.log" | grep -v -i "beta\|cannot be found" | head -20

if [ -z "${SKIP_CPU:-}" ]; then
  echo "== CPU suite (test double) on $($PY -V)"
  MEMVIZ_FUZZ_SECONDS=${MEMVIZ_FUZZ_SECONDS:-3} $PY -m pytest ${CPU_TESTS:-tests} -q --ignore=tests/gpu -p no:cacheprovider > "$OUT/cpu_tests.log" 2>&1
  tail -3 "$OUT/cpu_tests.log"
fi

if [ -z "${SKIP_GPU:-}" ]; then
  # GPU_TIMEOUT (seconds): the suite stopped there, so that a call's later parts still run
  # (the whole suite takes about 15 minutes on the H200; a device call may run 10)
  echo "== GPU suite"
  timeout ${GPU_TIMEOUT:-3000} $PY -m pytest ${GPU_TESTS:-tests/gpu} -m gpu -v -s -p no:cacheprovider --durations=20 > "$OUT/gpu_tests.log" 2>&1
  grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|static module" "$OUT/gpu_tests.log" | tail -40
fi

# PROFILE: one mode or several ("none memviz_after": the same step untracked and tracked, to
# compare which functions grow)
for PROF in ${PROFILE:-}; do
  # py-spy (carried as a wheel in .whl/) on one step loop, native frames included;
  # PROFILE_ARGS: more bench_train_step.py arguments (e.g. --model alloc_bound --steps 300)
  echo "== profile: $PROF"
  [ -d /tmp/pyspy ] || $PY -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall('/tmp/pyspy')" .whl/py_spy-*.whl
  SPY=$(ls /tmp/pyspy/py_spy-*.data/scripts/py-spy | head -1); chmod +x "$SPY"
  $SPY record --native --threads --rate ${PROFILE_RATE:-500} --format raw -o /tmp/profile_$PROF.txt -- \
      $PY benchmarks/bench_train_step.py --mode "$PROF" ${PROFILE_ARGS:---steps 40} > "$OUT/profile_$PROF.log" 2>&1
  echo "py-spy rc=$?"; tail -3 "$OUT/profile_$PROF.log"
  # PROFILE_WITHIN: the step's function(s), e.g. "alloc_bound_step torch::autograd::Engine::thread_main"
  WITHIN=""; for w in ${PROFILE_WITHIN:-}; do WITHIN="$WITHIN --within $w"; done
  $PY benchmarks/pyspy_summary.py /tmp/profile_$PROF.txt --top 60 --focus memviz --focus _core \
      --focus cupti --focus libcuda --focus Hook --focus hook $WITHIN > "$OUT/profile_summary_$PROF.txt" 2>&1
  gzip -c /tmp/profile_$PROF.txt > "$OUT/profile_$PROF.txt.gz"
  head -40 "$OUT/profile_summary_$PROF.txt"
done

if [ -z "${SKIP_DEMO:-}" ]; then
  echo "== demo"
  $PY -m memviz run examples/basic.py > "$OUT/demo.log" 2>&1; echo "demo rc=$?"
  tail -40 "$OUT/demo.log"
fi

if [ -n "${MINI_MODES:-}" ]; then
  echo "== mini benchmark: $MINI_MODES"
  $PY benchmarks/run_train_bench.py --rounds ${ROUNDS:-2} --modes "$MINI_MODES" --out "$OUT/mini_bench.json" 2>&1 | tail -12
fi

if [ -n "${COST:-}" ]; then
  # issue 27: the paired protocol on both steps, each configuration beside PyTorch's recorder
  for model in ${COST_MODELS:-alloc_bound gpt}; do
    echo "== cost: $model"
    $PY benchmarks/run_alternate_bench.py --procs ${PROCS:-5} --model $model \
        --configs ${COST_CONFIGS:-none,memviz_after,memviz_after_trace,memviz_after_flight,torch_history} \
        --cycles ${CYCLES:-6} --block ${BLOCK:-12} --out "$OUT/cost_$model.json" 2>&1 | tail -8
  done
fi
if [ -n "${TOGGLE:-}" ]; then
  # issue 27: runtime settings switched every step inside one tracked run (bench_toggle.py);
  # TOGGLE_MODES: rec:P[:dN] / noop:P, the first the baseline (rec:18: entries never queued)
  # TOGGLE_MODEL (alloc_bound, gpt), TOGGLE_TRACK (plain, trace, flight): the step and the session;
  # TOGGLE_AGAINST: another checkout (built here first), its processes alternating with this
  # tree's pair by pair (the summary compares the two builds' ratios pair by pair)
  echo "== toggle"
  AGAINST=""
  if [ -n "${TOGGLE_AGAINST:-}" ]; then
    (cd "$TOGGLE_AGAINST" && $PY setup.py -q build_ext --inplace > /dev/null 2>&1) && AGAINST="--against $TOGGLE_AGAINST" \
      || echo "TOGGLE_AGAINST=$TOGGLE_AGAINST did not build: this tree alone"
  fi
  $PY benchmarks/bench_toggle.py --procs ${TOGGLE_PROCS:-5} --rounds ${TOGGLE_ROUNDS:-160} $AGAINST \
      --model ${TOGGLE_MODEL:-alloc_bound} --track ${TOGGLE_TRACK:-plain} \
      --modes ${TOGGLE_MODES:-rec:2,rec:18,rec:2:d1,rec:10,noop:0} --out "$OUT/toggle.json" 2>&1 | tail -${TOGGLE_TAIL:-16}
fi
if [ -n "${ABLATE:-}" ]; then
  # issue 27: the same toggles on an ablation build of this tree (src/store.h, CFLAGS=-DMVZ_ABLATE),
  # in /tmp: rec:130 no autograd node read, rec:258 no clock read, rec:18 no queue, :d0 no walk
  echo "== ablate"
  rm -rf /tmp/memviz-ablate && mkdir -p /tmp/memviz-ablate && cp -r setup.py src memviz benchmarks /tmp/memviz-ablate/
  find /tmp/memviz-ablate -name "*.so" -delete
  (cd /tmp/memviz-ablate && CFLAGS=-DMVZ_ABLATE $PY setup.py -q build_ext --inplace > /dev/null 2>&1) || echo "ablation build failed"
  $PY /tmp/memviz-ablate/benchmarks/bench_toggle.py --procs ${ABLATE_PROCS:-6} --rounds ${ABLATE_ROUNDS:-100} \
      --model ${ABLATE_MODEL:-alloc_bound} --track ${ABLATE_TRACK:-plain} \
      --modes ${ABLATE_MODES:-rec:2,off,noop:0,rec:130,rec:258,rec:2:d0,rec:18,rec:402:d0} \
      --out "$OUT/ablate.json" 2>&1 | tail -${ABLATE_TAIL:-14}
fi
if [ -n "${IN_STEP:-}" ]; then
  # issue 27: memviz's own time inside the allocation-bound step, read from the capture path;
  # IN_STEP_AGAINST: another checkout (built here first) in alternating processes
  echo "== in step"
  AGAINST=""
  if [ -n "${IN_STEP_AGAINST:-}" ]; then
    (cd "$IN_STEP_AGAINST" && $PY setup.py -q build_ext --inplace > /dev/null 2>&1) && AGAINST="--against $IN_STEP_AGAINST"
  fi
  $PY benchmarks/bench_in_step.py --procs ${PROCS:-5} --steps ${STEPS:-200} $AGAINST --out "$OUT/in_step.json" 2>&1 | tail -4
fi
if [ -n "${STAGES:-}" ]; then
  # issue 27: the same step on a stage build of this tree (src/clock.h, CFLAGS=-DMVZ_STAGES), in /tmp
  echo "== stages"
  rm -rf /tmp/memviz-stages && mkdir -p /tmp/memviz-stages && cp -r setup.py src memviz benchmarks /tmp/memviz-stages/
  (cd /tmp/memviz-stages && CFLAGS=-DMVZ_STAGES $PY setup.py -q build_ext --inplace > /dev/null 2>&1) || echo "stage build failed"
  $PY /tmp/memviz-stages/benchmarks/bench_in_step.py --stages --procs ${STAGE_PROCS:-2} --out "$OUT/stages.json" 2>&1 | tail -3
fi
if [ -n "${LAUNCH:-}" ]; then
  # issue 27: what memviz (and CUPTI within it) adds to a kernel launch that allocates nothing
  echo "== launch"
  $PY benchmarks/bench_launch.py --procs ${PROCS:-5} --out "$OUT/launch.json" 2>&1 | tail -8
fi
if [ -n "${COST:-}${C_BENCH:-}" ] && [ -z "${SKIP_C_BENCH:-}" ]; then
  # C_AGAINST: another checkout to compare with (its extension is built here first)
  AGAINST=""
  if [ -n "${C_AGAINST:-}" ]; then
    (cd "$C_AGAINST" && $PY setup.py -q build_ext --inplace > /dev/null 2>&1) && AGAINST="--against $C_AGAINST"
  fi
  # C_SETS: which of the four runs (default all); NAME_burst: a step's rhythm, bursts of 100 pairs 1 ms apart
  for set in ${C_SETS:-32 64 32_burst 64_burst}; do
    d=${set%_burst}; burst=""
    [ "$set" != "$d" ] && burst="--n 50000 --burst 100"
    $PY benchmarks/bench_capture.py --depth $d --keep $d --cpu $burst $AGAINST > "$OUT/capture_$set.json" 2>&1
  done
  grep -H "per_event\|median" "$OUT"/capture_*.json
fi

if [ "${1:-quick}" = full ]; then
  echo "== benchmarks"
  $PY benchmarks/bench_step.py --torch-cuda > "$OUT/bench_step_gpu.json" 2>&1; tail -5 "$OUT/bench_step_gpu.json"
  $PY benchmarks/run_train_bench.py --rounds ${ROUNDS:-3} --modes ${MODES:-none,memviz,torch_history} \
      --out "$OUT/train_bench.json" 2>&1 | tail -30
fi
