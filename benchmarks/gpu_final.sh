#!/usr/bin/env bash
# The final numbers of docs/performance.md on 2 GPUs, in about three minutes of device time.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 OMP_NUM_THREADS=4 PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}; mkdir -p "$out"
run="python3 -m torch.distributed.run --standalone --nproc_per_node 2"
{
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
start=$(date +%s); python3 -c "from moedoctor.recorder import native; print('native build', native.available(), native.reason[-300:])"; echo "build seconds $(( $(date +%s) - start ))"
echo "== completion probe"; PYTHONPATH=. $run benchmarks/nccl_completion_probe.py 2>&1 | grep probe
for impl in 0 1; do
  echo "== per-collective NCCL, MOEDOCTOR_NATIVE=$impl"
  MOEDOCTOR_NATIVE=$impl PYTHONPATH=. $run benchmarks/recorder_overhead.py --backend nccl --iters 1000 --rounds 3 2>&1 | grep -v "Warn\|^ "
done
echo "== hot path"; PYTHONPATH=. python3 benchmarks/recorder_hot_path.py --iters 10000 --rounds 3 2>&1 | grep "us/coll\|recorded"
for impl in 1 0; do
  echo "== FSDP2 step, toggled every 5 steps, MOEDOCTOR_NATIVE=$impl"
  MOEDOCTOR_NATIVE=$impl PYTHONPATH=. $run benchmarks/fsdp_step_overhead.py --backend nccl --steps 80 --toggle 5 2>&1 | grep "toggled\|median"
done
} 2>&1 | tee "$out/final.txt"
