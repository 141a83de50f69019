#!/usr/bin/env bash
# Issue 31 on 2 GPUs (NCCL), one call of under 10 minutes: benchmarks/always_on.py on the host-bound
# FSDP2 loop (dim 512, 48 units, 1024 tokens: 145 collectives a step). First the checks (no host-device
# synchronisation under set_sync_debug_mode("error"); the native kernel's own clock), then three A/B runs
# of 100 pairs, the first installed by `moedoctor run` as users run it, pooled at the end (--pool).
# Logs and dumps in $OUT.
set -u
cd "$(dirname "$0")/.."
. benchmarks/_device_env.sh
out=${OUT:-/tmp/out}; mkdir -p "$out"
A="--backend nccl --dim 512 --tokens 1024"
# the first run also builds the native kernel (30-40 s on a fresh machine)
timeout 150 python3 benchmarks/always_on.py $A --pairs 20 --sync-debug > "$out/sync_debug.log" 2>&1
echo "sync-debug run: exit $? (0: no host-device synchronisation in a timed step)"
timeout 70 python3 benchmarks/always_on.py $A --pairs 12 --kernel-clock > "$out/kernel_clock.log" 2>&1
grep "native kernel" "$out/kernel_clock.log"
rm -f /tmp/ao-gpu-*.json
timeout 200 python3 -m moedoctor run --run-dir /tmp/always-on --force -- python3 -m torch.distributed.run \
  --standalone --nproc_per_node 2 benchmarks/always_on.py $A --pairs 100 --dump /tmp/ao-gpu-1.json > "$out/ab1.log" 2>&1
grep "recorded:\|always-on\|Analysis" "$out/ab1.log"
for i in 2 3; do
  timeout 150 python3 benchmarks/always_on.py $A --pairs 100 --dump /tmp/ao-gpu-$i.json > "$out/ab$i.log" 2>&1
  grep "always-on" "$out/ab$i.log"
done
cp /tmp/ao-gpu-*.json "$out/"
python3 benchmarks/always_on.py --pool /tmp/ao-gpu-*.json
