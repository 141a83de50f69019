#!/usr/bin/env bash
# Issue 10 ("do no harm") on NCCL, 2 GPUs: the healthy corpus under `moedoctor run` (no alarm may be
# raised), the fault fixtures whose verdict must match Gloo's (straggler, hardware_like), the new
# ones (all_to_all split mismatch: caught online; collective order inversion: named as such), a job
# set up by init_device_mesh alone (recorded, its desync diagnosed), and the fraction of collectives
# whose completion the recorder observes. Summary in $OUT/summary.txt, every output beside it, and
# as markdown in $OUT/$BACKEND-do-no-harm.md (also docs/$BACKEND-do-no-harm.md in this checkout: bring
# the $OUT copy back into docs/). BACKEND=gloo runs the same on CPU.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 OMP_NUM_THREADS=4 PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}; mkdir -p "$out"
logs=/tmp/moedoctor-nharm-logs; rm -rf "$logs"; mkdir -p "$logs"
pack() {  # at most 8 files come back from the GPU machine: every log and report in one archive
  tar czf "$out/logs.tgz" -C / "${logs#/}" $(cd / && ls -d "${runs#/}"/*/report.json "${runs#/}"/*/manifest.json \
    "${runs#/}"/healthy/*.log 2>/dev/null) 2>/dev/null
}
. benchmarks/_device_env.sh
md="python3 -m moedoctor"
launch="python3 -m torch.distributed.run --standalone --nproc_per_node 2"
backend=${BACKEND:-nccl}
runs=/tmp/moedoctor-nharm-runs; rm -rf "$runs"
summarize() {  # run dir, exit code, seconds
  python3 - "$@" <<'PY'
import json, sys
d, rc, secs = sys.argv[1:4]
try:
    m = json.load(open(d + "/manifest.json")); h = m.get("hang") or {}
except Exception as e:
    m, h = {}, {"error": repr(e)}
try:
    r = json.load(open(d + "/report.json"))
except Exception as e:
    r = {"verdict": f"no report ({e!r})", "pattern": None, "culprit_ranks": None, "divergence": None}
div = r.get("divergence") or {}
site = next((op["call_site"].rsplit("/", 1)[-1] for op in (div.get("per_rank") or {}).values() if op and op.get("call_site")), None)
sugg = (r.get("suggestion") or {}).get("call_site")
print(f"   exit {rc} in {secs} s | trigger {h.get('trigger')} latency_s {h.get('detection_latency_s')} | "
      f"{r.get('verdict')} {r.get('pattern')} culprit {r.get('culprit_ranks')} | site {site} / {sugg and sugg.rsplit('/', 1)[-1]}")
print(f"   summary: {r.get('summary', '')[:300]}")
PY
}
{
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'CPU')"
echo "== healthy corpus ($backend, 2 ranks)"
python3 benchmarks/healthy_corpus.py --backend "$backend" --nproc 2 --hang-timeout 30 --parallel ${PARALLEL:-3} --keep "$runs/healthy" 2>&1 | tail -25; pack
for name in all_to_all_split_mismatch collective_order_inversion straggler hardware_like; do
  t0=$(date +%s.%N)
  timeout 300 $md run --run-dir "$runs/$name" --hang-timeout 20 -- $launch "fixtures/$name/train.py" --backend "$backend" \
    --pg-timeout 60 > "$logs/$name.run.txt" 2>&1
  rc=$?
  echo "== $name"; summarize "$runs/$name" "$rc" "$(python3 -c "print(round($(date +%s.%N) - $t0, 1))")"; pack
done
for setup in "mesh" "mesh --desync"; do
  name="mesh_only${setup#mesh}"; name=${name// /}
  t0=$(date +%s.%N)
  timeout 300 $md run --run-dir "$runs/$name" --hang-timeout 20 -- $launch tests/jobs/group_setups.py --setup $setup \
    --backend "$backend" > "$logs/$name.run.txt" 2>&1
  rc=$?
  echo "== init_device_mesh only: --setup $setup"; summarize "$runs/$name" "$rc" "$(python3 -c "print(round($(date +%s.%N) - $t0, 1))")"
  grep -h "Coverage" "$logs/$name.run.txt" | head -2
done
echo "== completion observed ($backend)"
timeout 300 $md run --run-dir "$runs/completion" -- $launch benchmarks/nccl_completion.py --backend "$backend" \
  > "$logs/completion.run.txt" 2>&1
echo "   moedoctor run exit $?"
python3 benchmarks/nccl_completion.py --report "$runs/completion" 2>&1 | tail -15; pack
} 2>&1 | tee "$out/summary.txt"
python3 - "$out/summary.txt" "$backend" > "$out/$backend-do-no-harm.md" <<'PY'
import sys
text = open(sys.argv[1]).read().rstrip()
print(f"# Do no harm on {sys.argv[2].upper()} (`benchmarks/nccl_do_no_harm.sh`)\n")
print("2 ranks: the healthy corpus under `moedoctor run` (no alarm may be raised), the fault fixtures whose")
print("verdict must match Gloo's, an `init_device_mesh`-only job, and the completion the recorder observed")
print("(p2p ops counted apart). The script's own summary, as it printed it:\n")
print("```\n" + text + "\n```")
PY
cp "$out/$backend-do-no-harm.md" "docs/$backend-do-no-harm.md" 2>/dev/null
