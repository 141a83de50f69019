#!/usr/bin/env bash
# What a user pays for leaving moedoctor on (issue 14): plain torchrun against `moedoctor run` with its
# defaults, on the same FSDP2 loops (benchmarks/fsdp_step_overhead.py), launches interleaved
# (plain, moedoctor, plain, ... so drift hits both), ROUNDS rounds per model size, three sizes
# (the last with 100+ collectives per step). Prints per size the median over rounds of each launch's
# median step time, the spread (min-max of the launch medians), and the difference.
# GPU machine: bash benchmarks/step_overhead.sh   (BACKEND=gloo SIZES=... for a CPU smoke run)
# A size may carry a fourth field, dim:layers:tokens:MB, to train with DDP in buckets of MB megabytes
# instead of FSDP2 (on one GPU, where FSDP2 issues no collectives: NPROC=1 SIZES="1024:16:2048:11").
set -u
cd "$(dirname "$0")/.."
. benchmarks/_device_env.sh
backend=${BACKEND:-nccl}; rounds=${ROUNDS:-5}; steps=${STEPS:-30}; nproc=${NPROC:-2}
# dim:layers:tokens; FSDP2 one unit per block: about 3 collectives per block per step
sizes=${SIZES:-"2048:8:8192 1024:16:2048 512:48:1024"}
out=${OUT:-/tmp/out}; mkdir -p "$out"; log="$out/step_overhead.log"; : > "$log"
launch="python3 -m torch.distributed.run --standalone --nproc_per_node $nproc benchmarks/fsdp_step_overhead.py"
python3 -m moedoctor run --run-dir /tmp/so-warm --force -- $launch --backend "$backend" --dim 64 --layers 2 \
  --tokens 64 --steps 2 --warmup 1 >> "$log" 2>&1  # builds the native recorder once, outside the timings
for size in $sizes; do
  IFS=: read -r dim layers tokens mb <<< "$size"
  args="--backend $backend --dim $dim --layers $layers --tokens $tokens --steps $steps --warmup 5${mb:+ --ddp $mb}"
  for r in $(seq "$rounds"); do
    echo "== $size round $r plain" >> "$log"; $launch $args >> "$log" 2>&1
    echo "== $size round $r moedoctor" >> "$log"
    python3 -m moedoctor run --run-dir "/tmp/so-$r" --force -- $launch $args >> "$log" 2>&1
  done
done
python3 - "$log" <<'PY'
import re, statistics, sys
rows, cpu, size, mode = {}, {}, None, None
for line in open(sys.argv[1]):
    m = re.match(r"== (\S+) round \d+ (plain|moedoctor)", line)
    if m:
        size, mode = m.groups()
        continue
    m = re.search(r"median step ([\d.]+) ms .*collectives/step ([\d.]+)(?: thread CPU ([\d.]+) ms)?", line)
    if m and size:
        rows.setdefault(size, {}).setdefault(mode, []).append((float(m.group(1)), float(m.group(2))))
        if m.group(3):
            cpu.setdefault(size, {}).setdefault(mode, []).append(float(m.group(3)))
print(f"{'dim:layers:tokens':<18} {'coll/step':>9} {'plain ms (min-max)':>24} {'moedoctor ms (min-max)':>26} {'added':>8}")
for size, modes in rows.items():
    plain = [t for t, _ in modes.get("plain", [])]
    md = [t for t, _ in modes.get("moedoctor", [])]
    coll = max(c for v in modes.values() for _, c in v)
    if not plain or not md:
        print(f"{size:<18} incomplete: plain {len(plain)} launches, moedoctor {len(md)}")
        continue
    p, q = statistics.median(plain), statistics.median(md)
    print(f"{size:<18} {coll:>9.1f} {p:>9.2f} ({min(plain):.2f}-{max(plain):.2f}) {q:>11.2f} ({min(md):.2f}-{max(md):.2f})"
          f" {(q - p) / p * 100:>+7.2f}%  [{len(plain)}+{len(md)} launches]")
    c = cpu.get(size, {})
    if c.get("plain") and c.get("moedoctor"):
        cp, cq = statistics.median(c["plain"]), statistics.median(c["moedoctor"])
        print(f"{'':<18} training thread CPU per step: plain {cp:.2f} ms ({min(c['plain']):.2f}-{max(c['plain']):.2f}), "
              f"moedoctor {cq:.2f} ms ({min(c['moedoctor']):.2f}-{max(c['moedoctor']):.2f}), {(cq - cp) / cp * 100:+.2f}%")
PY
