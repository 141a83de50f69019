#!/usr/bin/env bash
# Issue 27 ("busy is not stuck") on NCCL, 2 GPUs, in one call of under 10 minutes: fixtures/broadcast_storm
# under `moedoctor run --hang-timeout 30` (its optimizer step over 18,027 DTensor parameters outlasted 30 s
# there: it must complete, exit 0, with its "slow, not stuck" section), the four healthy_busy_* jobs with
# their own short timeout (busy 2.5x longer: exit 0, healthy, the busy phase in the report), and the stuck
# fixtures straggler and hardware_like (still stopped and diagnosed as on Gloo). broadcast_storm_t5: the
# same job under a 5 s timeout, so that its silent phases are judged (busy). JOBS="a b" runs only those. Only python3 for
# arithmetic (the GPU machine has no `bc`). Summary in $OUT/busy_not_stuck_nccl.md, logs in $OUT/busy-logs.tgz.
# BACKEND=gloo runs the same on CPU.
set -u
cd "$(dirname "$0")/.."
. benchmarks/_device_env.sh
out=${OUT:-/tmp/out}; mkdir -p "$out"
backend=${BACKEND:-nccl}
runs=/tmp/moedoctor-busy-runs; rm -rf "$runs"; mkdir -p "$runs"
md="python3 -m moedoctor"
launch="python3 -m torch.distributed.run --standalone --nproc_per_node 2"
summary="$out/busy_not_stuck_nccl.md"
now() { python3 -c "import time; print(time.time())"; }
row() {  # name, run dir, exit code, start time
  python3 - "$@" <<'PY' >> "$summary"
import json, sys, time
name, d, rc, t0 = sys.argv[1:5]
secs = time.time() - float(t0)
try:
    m = json.load(open(d + "/manifest.json"))
except Exception as e:
    m = {"error": repr(e)}
try:
    r = json.load(open(d + "/report.json"))
except Exception as e:
    r = {"verdict": f"no report ({type(e).__name__})"}
h = m.get("hang") or {}
busy = "; ".join(f"{b['kind']} {b['seconds']:.0f} s: {b['line'][:160]}" for b in (m.get("busy") or [])[:2]) or "-"
slow = (r.get("slow") or {}).get("summary") or "-"
print(f"| {name} | {rc} | {secs:.0f} | {r.get('verdict')} {r.get('pattern') or ''} {r.get('culprit_ranks') or ''} | "
      f"{h.get('trigger', '-')} | {(h.get('proof') or '-')[:160]} | {busy} | {slow[:120]} |")
PY
}
{
echo "# Busy is not stuck on $backend ($(python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'CPU')"))"
echo
echo "| job | exit | s | verdict pattern culprit | hang trigger | proof | busy records | slow, not stuck |"
echo "|---|---|---|---|---|---|---|---|"
} > "$summary"
run() {  # name, timeout, script, args... (JOBS="a b": only those)
  local name=$1 timeout=$2 script=$3; shift 3
  [ -z "${JOBS:-}" ] || [[ " $JOBS " == *" $name "* ]] || return 0
  local t0; t0=$(now)
  timeout 240 $md run --run-dir "$runs/$name" --hang-timeout "$timeout" -- $launch "$script" --backend "$backend" "$@" \
    > "$runs/$name.log" 2>&1
  row "$name" "$runs/$name" $? "$t0"
}
run broadcast_storm 30 fixtures/broadcast_storm/train.py
run broadcast_storm_t5 5 fixtures/broadcast_storm/train.py  # its loading and optimizer phases outlast 5 s: busy
for job in healthy_busy_save_every_rank healthy_busy_rank0_save_barrier healthy_busy_dtensor_ema healthy_busy_first_compile; do
  args=$(python3 -c "import yaml; e = yaml.safe_load(open('fixtures/$job/expected.yaml')); print(e['hang_timeout'], ' '.join(e.get('args', [])))")
  run "$job" ${args%% *} "fixtures/$job/train.py" ${args#* }
done
run straggler 20 fixtures/straggler/train.py --pg-timeout 60
run hardware_like 20 fixtures/hardware_like/train.py --pg-timeout 60
tar czf "$out/busy-logs.tgz" -C "$runs" . 2>/dev/null
cat "$summary"
