#!/usr/bin/env bash
# Issue 15 on the GPU machine (2 GPUs, NCCL): the seeds' four further failures, each fixture run
# under `moedoctor run` with its defaults, then `moedoctor verify` with the fix the report names and
# with a wrong fix (which must fail), and the fixture's own --apply-fix for its time. Prints one line
# per step: the verdict, pattern, culprits and call site from report.json, the exit status and the
# wall time. Output in $OUT/seed_failures.log.
#   OUT=/tmp/out bash benchmarks/seed_failures_nccl.sh [FIXTURE ...]
set -u
cd "$(dirname "$0")/.."
. benchmarks/_device_env.sh
out=${OUT:-/tmp/out}; mkdir -p "$out"; log="$out/seed_failures.log"; : > "$log"
launch="python3 -m torch.distributed.run --standalone --nproc_per_node 2"
md="python3 -m moedoctor"; backend=${BACKEND:-nccl}

summary() {  # summary RUN_DIR: the report's verdict, pattern, culprits, call site (and the storm / params sections)
  python3 - "$1" <<'EOF'
import json, sys
try:
    r = json.load(open(sys.argv[1] + "/report.json"))
except OSError as e:
    print("no report:", e); sys.exit()
div = r.get("divergence") or {}
sites = sorted({str(v.get("call_site")) for v in (div.get("per_rank") or {}).values() if isinstance(v, dict) and v.get("call_site")})
extra = ""
if r.get("slow"):
    extra += " slow: " + str(r["slow"].get("summary"))
try:
    check = json.load(open(sys.argv[1] + "/params/check.json"))
    extra += " params: " + json.dumps(check)[:400]
except OSError:
    pass
print(f"verdict={r.get('verdict')} pattern={r.get('pattern')} culprits={r.get('culprit_ranks')} sites={sites} fix={r.get('fixes')}{extra}")
EOF
}

step() {  # step NAME COMMAND...: run it, log it, print its status and time
  local name=$1; shift
  local start=$(date +%s.%N)
  echo "== $name: $*" >> "$log"
  "$@" >> "$log" 2>&1; local rc=$?
  printf '%-58s exit %3s in %6.1f s\n' "$name" "$rc" "$(echo "$(date +%s.%N) - $start" | bc)" | tee -a "$log"
}

fixtures=${*:-"checkpoint_recompute_mismatch collective_in_checkpointed_region broadcast_storm overwritten_shards"}
for f in $fixtures; do
  dir=/tmp/seed-$f; script=fixtures/$f/train.py
  case $f in
    checkpoint_recompute_mismatch) opts="--hang-timeout 30"; fix=expert-dense; wrong=expert-zero-term ;;
    collective_in_checkpointed_region) opts="--hang-timeout 30"; fix=recompute-cache-collective; wrong=expert-dense ;;
    broadcast_storm) opts="--hang-timeout 30"; fix=coalesce-broadcasts; wrong="" ;;
    overwritten_shards) opts="--check-params"; fix=""; wrong="" ;;
  esac
  step "$f: moedoctor run" $md run --run-dir "$dir" --force $opts -- $launch $script --backend $backend --pg-timeout 60
  summary "$dir" | tee -a "$log"
  [ -n "$fix" ] && step "$f: verify --fix $fix" $md verify --fix "$fix" --run "$dir"
  [ -n "$wrong" ] && step "$f: verify --fix $wrong (must fail)" $md verify --fix "$wrong" --run "$dir"
  if [ $f = overwritten_shards ]; then
    step "$f: moedoctor run --check-params, --apply-fix" $md run --run-dir "$dir-fixed" --force $opts -- $launch $script --backend $backend --pg-timeout 60 --apply-fix
    summary "$dir-fixed" | tee -a "$log"
  else
    step "$f: plain torchrun --apply-fix" $launch $script --backend $backend --pg-timeout 60 --apply-fix
  fi
  grep -E "VERIFIED|NOT VERIFIED|storm|loading|params identical|checksum" "$log" | tail -4
done
