#!/usr/bin/env bash
# Issues 15 and 30 on the GPU machine (2 GPUs, NCCL): the seeds' four further failures in one call of
# at most 10 minutes. For each fixture: diagnosed under `moedoctor run`, then the fix the report names
# verified (`moedoctor verify --fix`; overwritten_shards has no fix module: its --apply-fix run under
# --check-params must come back clean), then a wrong fix, which must be refused (NOT VERIFIED, exit 1).
# Last, the completion the recorder observes on benchmarks/nccl_completion.py's mix (p2p included;
# COMPLETION=0 leaves it out). Two lanes of two fixtures run side by side (PARALLEL=1: one after the other); every step has its own
# timeout and the whole run a budget (BUDGET_S, default 480 s): a step that would start past it is
# skipped and the summary says so. Arithmetic in python3 only: the GPU machine has no calculator tool.
#
#   OUT=/tmp/out bash benchmarks/seed_failures_nccl.sh [FIXTURE ...]
#   BACKEND=gloo OUT=/tmp/out bash benchmarks/seed_failures_nccl.sh     # the same on CPU (dry run)
#
# Writes $OUT/$BACKEND-seed-failures.md (the summary; also docs/$BACKEND-seed-failures.md in this checkout:
# bring the $OUT copy back into docs/),
# $OUT/seed_failures.log (every step's output) and $OUT/seed-runs.tgz (each run's report.json,
# verification.json, manifest.json and job.log).
set -u
cd "$(dirname "$0")/.."
. benchmarks/_device_env.sh
out=${OUT:-/tmp/out}; mkdir -p "$out"
backend=${BACKEND:-nccl}; budget=${BUDGET_S:-480}; parallel=${PARALLEL:-2}
runs=/tmp/moedoctor-seed-runs; rm -rf "$runs"; mkdir -p "$runs"
steps="$runs/steps.tsv"; : > "$steps"  # fixture, step, exit, seconds, run dir, what was expected
launch="python3 -m torch.distributed.run --standalone --nproc_per_node 2"
md="python3 -m moedoctor"
now() { python3 -c 'import time; print(time.monotonic())'; }
t_start=$(now)

step() {  # step FIXTURE NAME EXPECT RUN_DIR TIMEOUT COMMAND...: run it within the budget, record it
  local fixture=$1 name=$2 expect=$3 dir=$4 limit=$5; shift 5
  local left; left=$(python3 -c "print(int($budget - ($(now) - $t_start)))")
  local log="$runs/$fixture.log"
  if [ "$left" -le 20 ]; then
    printf '%s\t%s\tskipped\t0\t%s\t%s\n' "$fixture" "$name" "$dir" "$expect" >> "$steps"
    echo "== $fixture: $name: skipped, $left s of the budget left" >> "$log"; return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0; t0=$(now)
  echo "== $fixture: $name (limit $limit s): $*" >> "$log"
  timeout -k 10 "$limit" "$@" >> "$log" 2>&1; local rc=$?
  local secs; secs=$(python3 -c "print(round($(now) - $t0, 1))")
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$fixture" "$name" "$rc" "$secs" "$dir" "$expect" >> "$steps"
  printf '%-36s %-44s exit %3s in %6s s\n' "$fixture" "$name" "$rc" "$secs" | tee -a "$log"
}

fixture() {  # the three steps of one fixture
  local f=$1 dir=$runs/$1 script=fixtures/$1/train.py opts="--hang-timeout 20" fix wrong args=""
  case $f in
    checkpoint_recompute_mismatch) fix=expert-dense; wrong=expert-zero-term ;;
    collective_in_checkpointed_region) fix=recompute-cache-collective; wrong=expert-dense ;;
    broadcast_storm) fix=coalesce-broadcasts; wrong=recompute-cache-collective
      # Smaller on CPU (time); its default size on GPU, where a smaller storm ends below the 3 s of a storm.
      [ "$backend" = nccl ] || args="--layers 2 --experts 700" ;;
    overwritten_shards) fix=""; wrong=expert-dense; opts="$opts --check-params" ;;
    *) echo "unknown fixture $f" >&2; return ;;
  esac
  step "$f" "moedoctor run $opts" diagnose "$dir" 150 \
    $md run --run-dir "$dir" --force $opts -- $launch "$script" --backend "$backend" --pg-timeout 60 $args
  if [ -n "$fix" ]; then
    step "$f" "verify --fix $fix" verified "$dir/verify-$fix" 150 \
      $md verify --fix "$fix" --run "$dir" --hang-timeout 20
  else
    step "$f" "moedoctor run $opts, --apply-fix" clean "$dir-fixed" 150 \
      $md run --run-dir "$dir-fixed" --force $opts -- $launch "$script" --backend "$backend" --pg-timeout 60 --apply-fix
  fi
  step "$f" "verify --fix $wrong (must be refused)" refused "$dir/verify-$wrong" 150 \
    $md verify --fix "$wrong" --run "$dir" --hang-timeout 20
}

fixtures=${*:-"checkpoint_recompute_mismatch collective_in_checkpointed_region broadcast_storm overwritten_shards"}
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'CPU')" \
  | tee "$runs/device.txt"
# The native recorder built once, before the lanes (else the first job of each builds it, 30-50 s, inside
# its own run); a failure here only means the jobs build it or fall back to the Python recorder.
timeout 150 python3 -m moedoctor.recorder.native > "$runs/build.log" 2>&1 || echo "native recorder build: see $runs/build.log"
if [ "$parallel" -ge 2 ]; then  # two lanes: fixtures 1, 3 and 2, 4 (each job uses both GPUs)
  set -- $fixtures
  lane1=""; lane2=""; i=0
  for f in "$@"; do if [ $((i % 2)) -eq 0 ]; then lane1="$lane1 $f"; else lane2="$lane2 $f"; fi; i=$((i + 1)); done
  (for f in $lane1; do fixture "$f"; done) &
  (for f in $lane2; do fixture "$f"; done) &
  wait
else
  for f in $fixtures; do fixture "$f"; done
fi
# Then, within what is left of the budget: completion observed on a mix with p2p (batch_isend_irecv), whose
# ops NCCL gives null Works (issue 30: decided from Flight Recorder at each rank's last poll).
if [ "${COMPLETION:-1}" = 1 ]; then
  step completion "moedoctor run nccl_completion.py" completion "$runs/completion" 120 \
    $md run --run-dir "$runs/completion" --force -- $launch benchmarks/nccl_completion.py --backend "$backend"
fi
total=$(python3 -c "print(round($(now) - $t_start, 1))")
cat "$runs"/*.log > "$out/seed_failures.log" 2>/dev/null

python3 benchmarks/seed_failures_summary.py "$steps" "$runs/device.txt" "$backend" "$total" "$budget" \
  > "$out/$backend-seed-failures.md"
cp "$out/$backend-seed-failures.md" "docs/$backend-seed-failures.md" 2>/dev/null
(cd / && tar czf "$out/seed-runs.tgz" $(cd / && ls -d "${runs#/}"/*/report.json "${runs#/}"/*/manifest.json \
  "${runs#/}"/*/job.log "${runs#/}"/*/verify-*/verification.json "${runs#/}"/*/verify-*/job.log \
  "${runs#/}"/*/params/check.json 2>/dev/null)) 2>/dev/null
cat "$out/$backend-seed-failures.md"
