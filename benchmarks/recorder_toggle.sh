#!/usr/bin/env bash
# Issue 14 on the GPU machine: the whole recorder's cost measured inside one process, where launch
# noise cannot hide it. Under `moedoctor run` with its defaults (native kernels built), each FSDP2 loop
# (benchmarks/fsdp_step_overhead.py --toggle) alternates blocks of steps with the recorder on and
# paused (Recorder.pause: kernels off the dispatcher, evidence hooks passing through); then the cost
# per collective on NCCL over many iterations (benchmarks/collective_cost.py), with the native
# kernel's own time split (a separate run with its clock on: --kernel-clock), the kernels and the hooks
# toggled alone on the largest loop where PARTS="kernels hooks" asks; then every step of the
# largest loop under torch.cuda.set_sync_debug_mode("error"), plain and recorded (no host-device sync
# may be added). Output in $OUT/recorder_toggle.log, summary lines printed.
set -u
cd "$(dirname "$0")/.."
. benchmarks/_device_env.sh
backend=${BACKEND:-nccl}; steps=${STEPS:-200}; block=${BLOCK:-5}; nproc=${NPROC:-2}
sizes=${SIZES:-"2048:8:8192 1024:16:2048 512:48:1024"}
out=${OUT:-/tmp/out}; mkdir -p "$out"; log="$out/recorder_toggle.log"; : > "$log"
launch="python3 -m torch.distributed.run --standalone --nproc_per_node $nproc"
md="python3 -m moedoctor run --run-dir /tmp/tg --force --"
toggle() {  # toggle SIZE [extra args]: one FSDP2 loop under `moedoctor run`, the recorder toggled in-process
  local dim layers tokens; IFS=: read -r dim layers tokens <<< "$1"; shift
  $md $launch benchmarks/fsdp_step_overhead.py --backend "$backend" --dim "$dim" --layers "$layers" \
    --tokens "$tokens" --steps "$steps" --warmup 5 --toggle "$block" "$@" >> "$log" 2>&1
  grep -E "^(native|toggled|recorded|plain|progress)" "$log" | tail -4
}
for size in $sizes; do  # the kernel's clock off: what users run
  echo "== $size" | tee -a "$log"; toggle "$size"
done
largest=${sizes##* }
echo "== $largest with the kernel's clock (its split; the clock's reads add to it)" | tee -a "$log"
toggle "$largest" --kernel-clock
if [ -n "${FRAMEWALK-}" ]; then
  echo "== $largest frame-object walk (MOEDOCTOR_FAST_WALK=0)" | tee -a "$log"
  MOEDOCTOR_FAST_WALK=0 toggle "$largest" --kernel-clock
fi
for part in ${PARTS-}; do  # where the time goes: the dispatcher kernels alone, the evidence hooks alone
  echo "== $largest $part only" | tee -a "$log"; toggle "$largest" --toggle-part "$part"
done
echo "== collective cost" | tee -a "$log"
$md $launch benchmarks/collective_cost.py --backend "$backend" --rounds "${ROUNDS:-20}" >> "$log" 2>&1
sed -n '/^== collective cost/,$p' "$log" | grep -E "^(collective cost|native)"
IFS=: read -r dim layers tokens <<< "$largest"
for mode in plain recorded; do
  echo "== sync debug $mode" | tee -a "$log"
  cmd="$launch benchmarks/fsdp_step_overhead.py --backend $backend --dim $dim --layers $layers --tokens $tokens --steps 10 --warmup 3 --sync-debug"
  if [ $mode = recorded ]; then $md $cmd >> "$log" 2>&1; else $cmd >> "$log" 2>&1; fi
  echo "exit $?"; grep -E "^sync debug|synchroniz|Error" "$log" | tail -3
done
