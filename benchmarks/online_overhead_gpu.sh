#!/usr/bin/env bash
# Does online desync detection (moedoctor's supervisor reading every trace record while the job
# runs) cost the job step time? The FSDP2 step benchmark under `moedoctor run --online` and
# `--no-online`, alternated, 3 rounds each, on 2 GPUs (NCCL). About 3 minutes of device time.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 OMP_NUM_THREADS=4 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
out=${OUT:-/tmp/out}; mkdir -p "$out"
for round in 1 2 3; do
  for mode in --online --no-online; do
    rd=/tmp/online-overhead/$round$mode; rm -rf "$rd"
    python3 -m moedoctor run --run-dir "$rd" --no-stacks $mode -- python3 -m torch.distributed.run --standalone \
      --nproc_per_node 2 benchmarks/fsdp_step_overhead.py --backend nccl --steps 300 --layers 4 --dim 1024 \
      --tokens 4096 > "$out/overhead$round$mode.txt" 2>&1
    echo "round $round $mode: $(grep -h 'median' "$rd/job.log" | head -1)"
  done
done 2>&1 | tee "$out/online_overhead.txt"
