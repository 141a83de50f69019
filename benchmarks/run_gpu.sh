#!/usr/bin/env bash
# The GPU numbers quoted in docs/performance.md: per-collective cost (recorder off / floor / on) and
# FSDP2 step time plain vs recorded, NCCL on every GPU of the machine, rounds interleaved.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 OMP_NUM_THREADS=4
n=$(python3 -c "import torch; print(torch.cuda.device_count())")
run="python3 -m torch.distributed.run --standalone --nproc_per_node $n"
echo "== per-collective, NCCL"
PYTHONPATH=. $run benchmarks/recorder_overhead.py --backend nccl --iters 2000 --rounds 7 2>&1 | grep -v Warn
echo "== per-collective, Gloo (same host)"
PYTHONPATH=. $run benchmarks/recorder_overhead.py --backend gloo --iters 1000 --rounds 5 2>&1 | grep -v Warn
echo "== FSDP2 step time, NCCL (plain, recorded, alternating 3x)"
for i in 1 2 3; do
  PYTHONPATH=. $run benchmarks/fsdp_step_overhead.py --backend nccl "$@" 2>&1 | grep "median step"
  rm -rf /tmp/moedoctor-bench-run
  MOEDOCTOR_RUN_DIR=/tmp/moedoctor-bench-run PYTHONPATH=moedoctor/_bootstrap:. $run benchmarks/fsdp_step_overhead.py --backend nccl "$@" 2>&1 | grep "median step"
done
ls -la /tmp/moedoctor-bench-run/traces 2>/dev/null
