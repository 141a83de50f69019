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
echo "== hot path (fake backend, one process, no communication)"
PYTHONPATH=. python3 benchmarks/recorder_hot_path.py --iters 20000 2>&1 | grep -v Warn
echo "== FSDP2 step time, NCCL, recorder kernels toggled in-process every 5 steps"
for cfg in "--dim 2048 --layers 8 --tokens 8192" "--dim 4096 --layers 8 --tokens 16384"; do
  PYTHONPATH=. $run benchmarks/fsdp_step_overhead.py --backend nccl $cfg --steps 80 --toggle 5 "$@" 2>&1 | grep "toggled\|median step"
done
echo "== FSDP2 step time, NCCL, plain vs whole recorder (separate launches, 2x)"
for i in 1 2; do
  PYTHONPATH=. $run benchmarks/fsdp_step_overhead.py --backend nccl --steps 60 "$@" 2>&1 | grep "median step"
  rm -rf /tmp/moedoctor-bench-run
  MOEDOCTOR_RUN_DIR=/tmp/moedoctor-bench-run PYTHONPATH=moedoctor/_bootstrap:. $run benchmarks/fsdp_step_overhead.py --backend nccl --steps 60 "$@" 2>&1 | grep "median step"
done
