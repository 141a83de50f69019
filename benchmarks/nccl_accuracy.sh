#!/usr/bin/env bash
# Issue 11 on NCCL (2 GPUs): the diagnosis-accuracy benchmark over the variants corpus
# (fixtures/variants; those of more ranks than GPUs are listed as skipped), after the two
# jobs of issue 10 that changed since its NCCL run (healthy_ep_dispatch, the init_device_mesh desync).
# Needs in .whl/: py-spy, ninja, and for the transformers 4.x variants transformers 4.53.2,
# tokenizers 0.21 and huggingface_hub 0.x wheels. Summary in $OUT/accuracy.txt, logs in $OUT/logs.tgz.
set -u
cd "$(dirname "$0")/.."
. benchmarks/_device_env.sh
out=${OUT:-/tmp/out}; mkdir -p "$out"
if ls .whl/transformers-4.* >/dev/null 2>&1 && [ ! -x .venv-tf4/bin/python ]; then
  # the GPU machine's python3 is itself a venv: a --system-site-packages venv of it would not see its
  # torch, so the transformers 4.x environment is a folder put first on PYTHONPATH
  pip install -q --no-deps --target /tmp/tf4site .whl/transformers-4.* .whl/tokenizers-* .whl/huggingface_hub-* >/dev/null 2>&1
  mkdir -p .venv-tf4/bin
  printf '#!/bin/sh\nPYTHONPATH=/tmp/tf4site:%s${PYTHONPATH:+:$PYTHONPATH} exec %s "$@"\n' "$PWD" "$(command -v python3)" \
    > .venv-tf4/bin/python
  chmod +x .venv-tf4/bin/python
  .venv-tf4/bin/python -c "import transformers; print('transformers', transformers.__version__)"
fi
runs=/tmp/moedoctor-acc-runs; rm -rf "$runs"; mkdir -p "$runs"
[ -n "${SKIP_ISSUE10:-}" ] || {
python3 benchmarks/healthy_corpus.py --backend nccl --nproc 2 --jobs healthy_ep_dispatch --keep "$runs/healthy" 2>&1 | tail -4
python3 -m moedoctor run --run-dir "$runs/mesh_desync" --hang-timeout 20 -- python3 -m torch.distributed.run --standalone \
  --nproc_per_node 2 tests/jobs/group_setups.py --setup mesh --desync --backend nccl > "$runs/mesh_desync.log" 2>&1
echo "init_device_mesh desync: exit $?"; python3 -m moedoctor analyze "$runs/mesh_desync" 2>&1 | head -8
} 2>&1 | tee "$out/issue10.txt"
timeout ${BUDGET:-520} python3 benchmarks/diagnosis_accuracy.py --backend nccl --jobs ${JOBS:-6} --no-healthy \
  --keep "$runs/acc" 2>"$out/progress.txt" | tee "$out/accuracy.txt"
tar czf "$out/logs.tgz" -C /tmp moedoctor-acc-runs 2>/dev/null  # traces too: --reanalyze needs them
ls -la "$out"
