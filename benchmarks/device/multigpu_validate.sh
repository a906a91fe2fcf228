#!/usr/bin/env bash
# Multi-GPU validation (issue 9), for a machine with 2 or more GPUs of one host.
#
# 1. the GPU tests of the comm layer: NCCL exchanges (all-gather, normal and low-latency
#    all-to-all domains) and, where `deep_ep` imports, DeepEP's normal P buffer and low-latency D
#    buffer used side by side in one process;
# 2. replay of one trace under off, chunked and mux (one process per GPU, NCCL), for the layouts
#    the GPU count allows: ATP1/ADP n and ATP n/ADP1, and ATP2/ADP2 on 4 GPUs.
# Results go to $OUT (default /tmp/multigpu). Wheels in .whl/ and .whl-x2/ are installed first
# when present. Fetch them on a machine with PyPI (git-ignore the folder, copy it to the GPU host):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_34_x86_64 \
#     -d .whl-x2 tokenspeed-deepep==1.2.1.post20251110 nvshmem4py-cu13==0.4.1 megatron-core==0.16.1
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/multigpu}
mkdir -p "$OUT"
wheels=$(ls .whl/*.whl .whl-x2/*.whl 2>/dev/null)
if [ -n "$wheels" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $wheels \
    && export PYTHONPATH=/tmp/site:$PWD
fi
n=$(python3 -c "import torch; print(torch.cuda.device_count())")
echo "GPUs: $n"
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
python3 -c "import deep_ep; print('deep_ep', deep_ep.__file__)" > "$OUT/deep_ep.txt" 2>&1

python3 -m pytest -q -p no:cacheprovider -m "gpu or multigpu" tests/comm tests/multiplex 2>&1 | tee "$OUT/pytest_gpu.log" | tail -15

python3 -m megatron_rollout.cli make-trace --conversations "${CONVERSATIONS:-32}" --scale "${SCALE:-0.05}" --out "$OUT/trace.jsonl"
layouts="1,$n $n,1"
[ "$n" -ge 4 ] && layouts="$layouts 2,$((n / 2))"
for layout in $layouts; do
  atp=${layout%,*}; adp=${layout#*,}
  timeout 300 torchrun --nproc_per_node "$n" -m megatron_rollout.cli replay --trace "$OUT/trace.jsonl" \
    --model "${MODEL:-tiny-moe}" --schedule off,chunked,mux --json --no-progress --device cuda \
    --atp "$atp" --adp "$adp" --timeout 60 > "$OUT/replay_atp${atp}_adp${adp}.json" 2> "$OUT/replay_atp${atp}_adp${adp}.err"
  echo "ATP$atp/ADP$adp exit $?"
  python3 -c "
import json, sys
for r in json.load(open(sys.argv[1]))['runs']:
    print(f\"  {r['schedule']:8s} makespan {r['makespan_s']:.2f}s p99 {r['p99_request_s']:.3f}s decode wait {r['mean_decode_wait_ms']:.1f}ms\")
" "$OUT/replay_atp${atp}_adp${adp}.json" || tail -5 "$OUT/replay_atp${atp}_adp${adp}.err"
done

# 3. the multi-rank CUDA runner (issue 15): decode graphs that capture NCCL collectives on D's own
#    communicators, P eager on its stream with P's communicators, counts consumed on the device,
#    and the routed P all-reduce on D's stream. What one GPU could not show: collectives pairing
#    up across ranks (collective capture warm-ups, ranks replaying different buckets, replicas
#    without decode rows), the model's ATP all-reduce / all-gather, the crossed ATP2/ADP2 order
#    under the turnstile, and cross-rank sequence checks. Each layout and exchange pair runs mux
#    with the CUDA runner and with the eager runner (the reference); a hang shows as exit 124.
python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_cuda_runner_multirank.py 2>&1 \
  | tee "$OUT/pytest_cuda_runner_multirank.log" | tail -5
for layout in $layouts; do
  atp=${layout%,*}; adp=${layout#*,}
  for exchanges in "allgather alltoall" "alltoall alltoall" "allgather allgather"; do
    set -- $exchanges
    for runner in cuda eager; do
      name="runner_${runner}_atp${atp}_adp${adp}_p$1_d$2"
      timeout 300 torchrun --nproc_per_node "$n" -m megatron_rollout.cli replay --trace "$OUT/trace.jsonl" \
        --model "${MODEL:-tiny-moe}" --schedule off,mux --json --no-progress --device cuda --runner "$runner" \
        --atp "$atp" --adp "$adp" --p-exchange "$1" --d-exchange "$2" --timeout 60 \
        > "$OUT/$name.json" 2> "$OUT/$name.err"
      echo "$name exit $?"
      grep -h "decode graphs dropped\|SequenceMismatch\|not graph-safe" "$OUT/$name.err" | head -3
    done
  done
done
