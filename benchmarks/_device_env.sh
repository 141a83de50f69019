# Sourced by the GPU machine's benchmark scripts, from the repository root: the NCCL settings every
# command there needs, py-spy and ninja from the wheels carried in .whl/ (the machine has no package
# index) when they are missing, and this checkout on PYTHONPATH.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
for tool in py-spy ninja; do
  command -v $tool >/dev/null || pip install -q --target /tmp/site .whl/${tool/-/_}-*.whl >/dev/null 2>&1
done
export PATH=/tmp/site/bin:$PATH PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
