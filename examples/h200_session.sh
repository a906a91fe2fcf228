#!/usr/bin/env bash
# One H200 lease, in stages, each a `device` call made right after the previous one (the machine
# stays warm ~30 s, and /tmp with it). vLLM's bundle travels as five pieces, one per call
# (../shared/peers/README.md); every call does measuring work beside its piece.
#
#   call 1, carry [".run", ".vb4"]: bash .run/examples/h200_session.sh setup tests
#   call 2, carry [".vb0"]:         bash /tmp/run/examples/h200_session.sh piece current
#   call 3, carry [".vb1"]:         bash /tmp/run/examples/h200_session.sh piece prefill
#   call 4, carry [".vb2"]:         bash /tmp/run/examples/h200_session.sh piece kernels
#   call 5, carry [".vb3"]:         bash /tmp/run/examples/h200_session.sh piece vllm hotswap
# (2026-12-01 the tests and kernels stages ran in earlier leases of the same session, to fit the
# 30-minute device budget: setup current / piece prefill / piece / piece / piece vllm / hotswap.)
#
# `.run` is `git archive HEAD` of the commit measured, plus `.whl/` (megatron-core 0.19.2, which
# the device image lacks); it is copied to /tmp/run so later calls need not carry it. Results are
# kept under /tmp/res (the vLLM stage reads our runs back with `bench.rollout --resume`) and
# copied to $OUT.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:/tmp/run
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p /tmp/pc /tmp/res
bench() { python3 -m megatron_rollout.bench.rollout --no-progress "$@"; }

for stage in "$@"; do
  case "$stage" in
    setup)  # code to /tmp/run, megatron-core to /tmp/site
      rm -rf /tmp/run && cp -r "$(dirname "$0")/.." /tmp/run
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/run/.whl/*.whl
      for d in .vb*; do [ -d "$d" ] && mv "$d"/* /tmp/pc/; done
      nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm,clocks.mem --format=csv
      git -C /tmp/run log -1 --format=%H 2>/dev/null || cat /tmp/run/COMMIT 2>/dev/null ;;
    piece)  # this call's piece of the vLLM bundle
      for d in .vb*; do [ -d "$d" ] && mv "$d"/* /tmp/pc/; done; ls -l /tmp/pc ;;
    tests)  # every GPU-marked test
      cd /tmp/run
      timeout 170 python3 -m pytest -q -m gpu tests -p no:cacheprovider --timeout 120 -rf 2>&1 \
        | tee "$OUT/gpu_tests.log" | tail -15 ;;
    hotswap)  # update_weights at full size: copy, bind, reshard
      cd /tmp/run
      timeout 100 python3 -m megatron_rollout.bench.hotswap --model qwen3-30b-a3b --json \
        > "$OUT/hotswap.json" 2> "$OUT/hotswap.err"; tail -c 1200 "$OUT/hotswap.json"; tail -3 "$OUT/hotswap.err" ;;
    current|prefill)  # our schedules: budget sweep, then 3 interleaved warm repeats
      cd /tmp/run
      bench --profile "$stage" --repeats 3 --no-vllm --deadline-s 185 --out "/tmp/res/$stage" > "/tmp/res/$stage.log" 2>&1
      tail -14 "/tmp/res/$stage.log"; cp "/tmp/res/$stage/rollout.json" "$OUT/$stage.json" ;;
    kernels)  # fused small ops and the decode step; the micro stage (prefill rate, attention, experts)
      cd /tmp/run
      timeout 90 python3 -m megatron_rollout.bench.kernels --json --out "$OUT/kernels.json" > /tmp/res/kernels.log 2>&1
      tail -22 /tmp/res/kernels.log
      timeout 100 python3 -m megatron_rollout.bench.rollout --schedules '' --micro --no-vllm --out /tmp/res/micro \
        > /tmp/res/micro.log 2>&1; tail -12 /tmp/res/micro.log; cp /tmp/res/micro/rollout.json "$OUT/micro.json" ;;
    vllm)  # unpack the bundle, then the peer on each profile's trace, against our runs
      mkdir -p /tmp/pv/site
      [ -d /tmp/pv/site/vllm ] || (cat /tmp/pc/vllm026.txz.0* | xz -dc -T8 | tar -x -C /tmp/pv/site)
      cd /tmp/run
      for p in current prefill; do  # prefill: vLLM's own budget only (each start-up costs ~1 min)
        if [ "$p" = current ]; then b=default,best; d=250; else b=default; d=190; fi
        bench --profile "$p" --resume "/tmp/res/$p" --vllm --vllm-site /tmp/pv/site --vllm-budgets "$b" \
          --deadline-s "$d" --vllm-reserve-s "$d" > "/tmp/res/$p.vllm.log" 2>&1
        tail -9 "/tmp/res/$p.vllm.log"; cp "/tmp/res/$p/rollout.json" "$OUT/$p.json"
        cp "/tmp/res/$p/vllm.log" "$OUT/$p.vllm.log" 2>/dev/null
      done ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
