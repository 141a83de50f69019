#!/usr/bin/env bash
# Issue 29, point 5 (NOT RUN YET: written without a GPU; the next session with 2 GPUs runs it):
# torchtitan's MoE debug model (DeepSeek-V3 `debugmodel`: expert parallel 2 + FSDP2 over 2 GPUs, no
# pipeline) under `moedoctor run`, against plain torchrun, launches interleaved (plain, moedoctor, ...,
# ROUNDS rounds, so drift hits both). Checks for each moedoctor launch: exit 0, report verdict `healthy`,
# coverage clean (manifest `coverage`: every rank's counts equal the process groups' own sequence
# counters), and prints the median step time of each launch (from torchtitan's per-step `tps`:
# tokens per second per device; step time = local_batch_size * seq_len / tps) and the difference.
#
# Needs (the GPU machine reaches no package index):
#   1. a torchtitan checkout at $TORCHTITAN (default .torchtitan/, its tests/assets hold the test
#      tokenizer and the c4_test data set the debug model trains on). On a machine with network:
#        git clone --depth 1 --branch "${TITAN_TAG:-v0.3.0}" https://github.com/pytorch/torchtitan .torchtitan
#   2. its Python requirements as wheels in .whl/torchtitan/ (same machine, same Python 3.11):
#        pip download --only-binary=:all: --python-version 3.11 -d .whl/torchtitan \
#          -r .torchtitan/requirements.txt   # torch itself is not downloaded: the GPU machine has it
#      (datasets pulls pyarrow: check the total stays under the run tool's 64 MiB carry limit).
#   Then on the GPU machine, from the repository root (carry .torchtitan and .whl):
#        bash benchmarks/torchtitan_moe_gpu.sh
# Output: $OUT/torchtitan_moe.md (one row per launch, then medians), logs in $OUT/torchtitan-logs/.
# Which torchtitan tag works with the torch of the GPU machine is not known yet: if the debug model
# does not start under plain torchrun, the row says so and moedoctor is not to blame (try TITAN_TAG).
set -u
cd "$(dirname "$0")/.."
. benchmarks/_device_env.sh
titan=$(realpath "${TORCHTITAN:-.torchtitan}")
rounds=${ROUNDS:-3}; steps=${STEPS:-40}; warm=${WARM:-10}
out=${OUT:-/tmp/out}; logs="$out/torchtitan-logs"; mkdir -p "$logs"; summary="$out/torchtitan_moe.md"
[ -d "$titan/torchtitan" ] || { echo "no torchtitan checkout at $titan (see the header)"; exit 2; }
if [ -d .whl/torchtitan ]; then
  pip install -q --no-index --find-links .whl/torchtitan -r "$titan/requirements.txt" >> "$logs/pip.log" 2>&1 ||
    { echo "installing torchtitan's requirements from .whl/torchtitan failed: $logs/pip.log"; exit 2; }
fi
export PYTHONPATH=$titan:$PYTHONPATH
# The debug model's own config, with expert parallel 2 + FSDP2 over 2 GPUs, no pipeline, no profiler,
# a longer sequence (the debug config's seq_len 4 would time only the launch overhead), log every step.
cfg="$logs/debug_moe_ep2_fsdp2.toml"
python3 - "$titan/torchtitan/models/deepseek_v3/train_configs/debug_model.toml" "$cfg" "$steps" <<'PY'
import sys, tomllib
src, dst, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
c = tomllib.load(open(src, "rb"))
c.setdefault("parallelism", {}).update(data_parallel_replicate_degree=1, data_parallel_shard_degree=2,
    tensor_parallel_degree=1, pipeline_parallel_degree=1, expert_parallel_degree=2, context_parallel_degree=1)
c["parallelism"].pop("pipeline_parallel_schedule", None)
c.setdefault("training", {}).update(steps=steps, seq_len=2048, local_batch_size=4)
c.setdefault("profiling", {})["enable_profiling"] = False
c.setdefault("metrics", {})["log_freq"] = 1
c.setdefault("checkpoint", {})["enable"] = False
c.setdefault("compile", {})["enable"] = False
def value(v):
    if isinstance(v, bool): return "true" if v else "false"
    if isinstance(v, str): return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list): return "[" + ", ".join(value(x) for x in v) + "]"
    return repr(v)
def write(table, prefix, f):
    flat = {k: v for k, v in table.items() if not isinstance(v, dict)}
    if prefix and flat: f.write(f"[{prefix}]\n")
    for k, v in flat.items(): f.write(f"{k} = {value(v)}\n")
    for k, v in table.items():
        if isinstance(v, dict): write(v, f"{prefix}.{k}" if prefix else k, f)
with open(dst, "w") as f: write(c, "", f)
PY
launch="python3 -m torch.distributed.run --standalone --nproc_per_node 2 -m torchtitan.train --job.config_file $cfg"
{
echo "# torchtitan MoE debug model, EP 2 + FSDP2, 2 GPUs ($(python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0))"), torchtitan $(git -C "$titan" describe --tags --always 2>/dev/null))"
echo
echo "| launch | exit | verdict | coverage | median step (ms, steps > $warm) |"
echo "|---|---|---|---|---|"
} > "$summary"
row() {  # label, log, exit code, run dir or ""
  python3 - "$@" "$warm" "$cfg" <<'PY' >> "$summary"
import json, re, statistics, sys, tomllib
label, log, rc, run_dir, warm, cfg = sys.argv[1:7]
t = tomllib.load(open(cfg, "rb"))["training"]
tokens = t["local_batch_size"] * t["seq_len"]
ms = []  # every rank's logged steps after the warm-up (ranks log alike under plain torchrun)
for line in open(log, errors="replace"):
    m = re.search(r"step:\s*(\d+).*?tps:\s*([\d,]+)", re.sub(r"\x1b\[[0-9;]*m", "", line))
    if m and int(m.group(1)) > int(warm):
        ms.append(1000.0 * tokens / max(1, int(m.group(2).replace(",", ""))))
verdict = coverage = "-"
if run_dir:
    try:
        verdict = json.load(open(run_dir + "/report.json"))["verdict"]
    except Exception as e:
        verdict = f"no report ({type(e).__name__})"
    try:
        cov = json.load(open(run_dir + "/manifest.json")).get("coverage")
        coverage = "clean" if cov and cov.get("complete") and not cov.get("gaps") else json.dumps(cov)[:200]
    except Exception as e:
        coverage = f"no manifest ({type(e).__name__})"
step = f"{statistics.median(ms):.1f} (n={len(ms)})" if ms else "no step logged"
print(f"| {label} | {rc} | {verdict} | {coverage} | {step} |")
PY
}
for r in $(seq "$rounds"); do
  timeout 580 $launch > "$logs/plain-$r.log" 2>&1; row "plain $r" "$logs/plain-$r.log" $? ""
  timeout 580 python3 -m moedoctor run --run-dir "/tmp/titan-run-$r" --force -- $launch > "$logs/moedoctor-$r.log" 2>&1
  row "moedoctor $r" "$logs/moedoctor-$r.log" $? "/tmp/titan-run-$r"
  cp "/tmp/titan-run-$r/manifest.json" "$logs/manifest-$r.json" 2>/dev/null
done
cat "$summary"
