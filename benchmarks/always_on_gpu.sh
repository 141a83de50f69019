#!/usr/bin/env bash
# Issue 31 on 2 GPUs (NCCL): benchmarks/always_on.py on the host-bound FSDP2 loop (dim 512, 48 units,
# 1024 tokens: 145 collectives a step). Logs and dumps in $OUT. Each part fits a call of under 10 minutes:
#
#   OUT=$OUT bash benchmarks/always_on_gpu.sh checks       # no host-device synchronisation under
#       set_sync_debug_mode("error"); the native kernel's own clock, cache hits recorded without the GIL
#       and with it (MOEDOCTOR_GIL_FREE=0); benchmarks/kernel_cold.py on the host's CPU
#   OUT=$OUT bash benchmarks/always_on_gpu.sh ab 1 3       # A/B runs 1..3 of 100 pairs (run 1 installed by
#       `moedoctor run` as users run it), then every run's pairs in $OUT pooled (--pool). A run takes
#       120-160 s on the 2x H200 host; on a fresh machine, `checks` first (it builds the native kernel,
#       30-40 s, which a run's own limit would otherwise have to absorb)
#   OUT=$OUT bash benchmarks/always_on_gpu.sh              # both: checks, then runs 1..3
set -u
cd "$(dirname "$0")/.."
. benchmarks/_device_env.sh
out=${OUT:-/tmp/out}; mkdir -p "$out"
A="--backend nccl --dim 512 --tokens 1024"

checks() {
  # the first run also builds the native kernel (30-40 s on a fresh machine)
  timeout 150 python3 benchmarks/always_on.py $A --pairs 20 --sync-debug > "$out/sync_debug.log" 2>&1
  echo "sync-debug run: exit $? (0: no host-device synchronisation in a timed step)"
  timeout 70 python3 benchmarks/always_on.py $A --pairs 12 --kernel-clock > "$out/kernel_clock.log" 2>&1
  grep "native kernel" "$out/kernel_clock.log"
  MOEDOCTOR_GIL_FREE=0 timeout 70 python3 benchmarks/always_on.py $A --pairs 12 --kernel-clock \
    > "$out/kernel_clock_gil.log" 2>&1
  grep "native kernel" "$out/kernel_clock_gil.log"
  timeout 100 python3 benchmarks/kernel_cold.py --versus nogil --rounds 11 --iters 200 --evict-kib 65536 \
    > "$out/kernel_cold.log" 2>&1
  grep -v "^round" "$out/kernel_cold.log" | tail -3
}

ab() {
  for i in $(seq "$1" "$2"); do
    if [ "$i" = 1 ]; then
      timeout 300 python3 -m moedoctor run --run-dir /tmp/always-on --force -- python3 -m torch.distributed.run \
        --standalone --nproc_per_node 2 benchmarks/always_on.py $A --pairs 100 --dump "$out/ao-gpu-1.json" \
        > "$out/ab1.log" 2>&1
      grep "recorded:\|always-on\|Analysis" "$out/ab1.log"
    else
      timeout 240 python3 benchmarks/always_on.py $A --pairs 100 --dump "$out/ao-gpu-$i.json" > "$out/ab$i.log" 2>&1
      grep "always-on" "$out/ab$i.log"
    fi
  done
  python3 benchmarks/always_on.py --pool "$out"/ao-gpu-*.json
}

case "${1:-all}" in
  checks) checks ;;
  ab) ab "${2:-1}" "${3:-3}" ;;
  *) checks; ab 1 3 ;;
esac
