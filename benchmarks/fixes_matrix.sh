#!/usr/bin/env bash
# docs/fixes.md's NCCL table and the online-detection latency on NCCL (2 GPUs): every desync fixture
# under `moedoctor run`, then `moedoctor verify` with its fix; one wrong fix; then `moedoctor triage`
# on a fixture started with plain torchrun and the NCCL Flight Recorder pipe enabled.
# About 4 minutes of device time. Summary in $OUT/summary.txt, full outputs beside it.
# BACKEND=gloo runs the same on CPU (no GPU needed; the Flight Recorder pipe is NCCL's only).
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 OMP_NUM_THREADS=4 PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}; mkdir -p "$out"
if ! command -v py-spy >/dev/null; then
  pip install -q --target /tmp/site .whl/py_spy-*.whl >/dev/null 2>&1; export PATH=/tmp/site/bin:$PATH
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
md="python3 -m moedoctor"
launch="python3 -m torch.distributed.run --standalone --nproc_per_node 2"
backend=${BACKEND:-nccl}
runs=/tmp/moedoctor-gpu-runs; rm -rf "$runs"
{
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'CPU')"
for spec in inactive_experts:expert-dense skipped_optimizer_step:skip-step-collectively \
            inflight_metric_allreduce:metrics-after-microbatches uneven_dtensor_allgather:key-manifest-checkpoint \
            collective_in_checkpointed_region:recompute-cache-collective; do
  name=${spec%%:*}; fix=${spec##*:}
  t0=$(date +%s.%N)
  $md run --run-dir "$runs/$name" --hang-timeout 20 -- $launch "fixtures/$name/train.py" --backend $backend --pg-timeout 60 \
    > "$out/$name.run.txt" 2>&1
  rc=$?
  echo "== $name: moedoctor run exit $rc in $(python3 -c "print(round($(date +%s.%N) - $t0, 1))") s"
  python3 - "$runs/$name" <<'PY'
import json, sys
m = json.load(open(sys.argv[1] + "/manifest.json")); h = m.get("hang") or {}
r = json.load(open(sys.argv[1] + "/report.json"))
print("   trigger", h.get("trigger"), "latency_s", h.get("detection_latency_s"), "|", r["verdict"], r["pattern"],
      r["culprit_ranks"], "|", h.get("finding"))
PY
  t0=$(date +%s.%N)
  $md verify --fix "$fix" --run "$runs/$name" > "$out/$name.verify.txt" 2>&1
  echo "   verify --fix $fix: exit $? in $(python3 -c "print(round($(date +%s.%N) - $t0, 1))") s"
  python3 - "$runs/$name/verify-$fix/verification.json" <<'PY'
import json, sys
v = json.load(open(sys.argv[1]))
for c in v["checks"]:
    print(f"   {'PASS' if c['passed'] else 'FAIL' if c['failed'] else 'info'} {c['name']}: {c['before']} -> {c['after']}")
PY
done
$md verify --fix expert-dense --run "$runs/skipped_optimizer_step" --hang-timeout 20 > "$out/wrong.verify.txt" 2>&1
echo "== wrong fix (expert-dense on skipped_optimizer_step): exit $?"
grep -A4 "NOT VERIFIED" "$out/wrong.verify.txt"

echo "== triage of a plain torchrun job (inflight_metric_allreduce), Flight Recorder pipe enabled"
export TORCH_NCCL_TRACE_BUFFER_SIZE=2000 TORCH_NCCL_DEBUG_INFO_TEMP_FILE=/tmp/fr/nccl_trace_rank_ \
       TORCH_NCCL_DEBUG_INFO_PIPE_FILE=/tmp/fr/pipe_
mkdir -p /tmp/fr
setsid $launch fixtures/inflight_metric_allreduce/train.py --backend $backend --pg-timeout 600 > "$out/triage_job.txt" 2>&1 &
job=$!
sleep 30
t0=$(date +%s.%N)
$md triage --pid $job --out "$runs/triage" > "$out/triage.txt" 2>&1
echo "   triage exit $? in $(python3 -c "print(round($(date +%s.%N) - $t0, 1))") s; job alive after: $(kill -0 $job 2>/dev/null && echo yes || echo no)"
head -30 "$out/triage.txt"
ls "$runs/triage/flight_recorder" 2>&1 | head
kill -9 -- -$job 2>/dev/null; pkill -9 -f inflight_metric_allreduce; sleep 2
} 2>&1 | tee "$out/summary.txt"
