#!/usr/bin/env bash
# The native recording kernel on a GPU machine (2+ GPUs): build it, its unit tests, the hot-path
# benchmark, the per-collective cost on NCCL with the Python and the native kernels, and an FSDP2
# job on NCCL recorded by each, traces compared record by record.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/moedoctor-ext}
n=$(python3 -c "import torch; print(torch.cuda.device_count())")
python3 -c "import sys, torch; print('torch', torch.__version__, 'python', sys.version.split()[0])"
echo "== build"
start=$(date +%s)
PYTHONPATH=. python3 -c "from moedoctor.recorder import native; print('available', native.available(), native.reason[-3000:])"
echo "build+load seconds: $(( $(date +%s) - start ))"
echo "== unit tests"
python3 -m pytest -q -p no:cacheprovider tests/unit/test_native_kernel.py 2>&1 | tail -3
echo "== hot path (fake backend)"
OMP_NUM_THREADS=1 PYTHONPATH=. python3 benchmarks/recorder_hot_path.py --iters 10000 --rounds 3 2>&1 | grep -v Warn | tail -5
run="python3 -m torch.distributed.run --standalone --nproc_per_node $n"
for k in 0 1; do
  echo "== per-collective, NCCL, MOEDOCTOR_NATIVE=$k"
  MOEDOCTOR_NATIVE=$k OMP_NUM_THREADS=4 PYTHONPATH=. $run benchmarks/recorder_overhead.py --backend nccl --iters 1000 --rounds 3 2>&1 | grep -v Warn | tail -8
done
for k in 0 1; do
  echo "== FSDP2 on NCCL recorded, MOEDOCTOR_NATIVE=$k"
  rm -rf /tmp/native-run-$k
  MOEDOCTOR_NATIVE=$k MOEDOCTOR_RUN_DIR=/tmp/native-run-$k OMP_NUM_THREADS=4 PYTHONPATH=moedoctor/_bootstrap:. \
    $run benchmarks/fsdp_step_overhead.py --backend nccl --steps 10 --warmup 2 2>&1 | grep -v Warn | tail -3
done
PYTHONPATH=. python3 - <<'PY'
from dataclasses import fields
from moedoctor.trace.reader import read_traces
py, nat = read_traces("/tmp/native-run-0/traces"), read_traces("/tmp/native-run-1/traces")
for p, n in zip(py, nat):
    diffs = 0
    for a, b in zip(p.events, n.events):
        for f in fields(a):
            x, y = getattr(a, f.name), getattr(b, f.name)
            if f.name in ("time", "completed") or (f.name == "reduce_op" and x is None):
                continue
            if x != y:
                diffs += 1
                if diffs <= 5: print("diff", p.rank, a.event_id, f.name, x, y)
    errors = [e.data for t in (p, n) for e in t.evidence if e.kind == "recorder_error"]
    print(f"rank {p.rank}: events python {len(p.events)} native {len(n.events)}, field diffs {diffs}, "
          f"coverage python {p.coverage[-1].complete} native {n.coverage[-1].complete}, "
          f"uncompleted c10d native {sum(1 for e in n.events if e.raw_op.startswith('c10d') and not e.completed)}, "
          f"threads {sorted({e.thread for e in n.events})}, errors {errors}")
PY
