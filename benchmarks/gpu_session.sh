#!/usr/bin/env bash
# One device session on a machine with 2+ GPUs. PARTS (default "bench demo") chooses:
#   bench    per-collective cost (NCCL and Gloo) and FSDP2 step time plain vs recorded
#   demo     a fixture that hangs on NCCL, under `moedoctor run` (stacks, NVML snapshot, coverage)
#   fixtures the fixture matrix on NCCL for $FIXTURES (default: all)
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}; mkdir -p "$out"
parts=${PARTS:-bench demo}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$out/gpu.txt"
case " $parts " in *" bench "*)
  bash benchmarks/run_gpu.sh "$@" 2>&1 | tee "$out/bench.txt" ;; esac
case " $parts " in *" demo "*)
  rm -rf /tmp/demo
  timeout 240 python3 -m moedoctor run --run-dir /tmp/demo --hang-timeout 15 -- \
    python3 -m torch.distributed.run --standalone --nproc_per_node 2 fixtures/inflight_metric_allreduce/train.py \
    --backend nccl --pg-timeout 300 > "$out/demo.out" 2> "$out/demo.err"
  echo "moedoctor run exit $?" | tee -a "$out/demo.err"
  tail -30 "$out/demo.err"
  cp /tmp/demo/manifest.json "$out/demo_manifest.json"; cp /tmp/demo/gpu/*.json "$out/demo_gpu.json"
  tar czf "$out/demo_run.tgz" -C /tmp demo ;; esac
case " $parts " in *" fixtures "*)
  python3 fixtures/run_matrix.py --backend nccl --timeout 75 --pg-timeout 10 ${FIXTURES:+--only $FIXTURES} 2>&1 | tee "$out/matrix_nccl.md" ;; esac
