#!/usr/bin/env bash
# The one-GPU benchmarks on an H200, as named stages run in order: `bash h200_session.sh setup tests
# current vllm`. A device machine that keeps /tmp between commands may run the stages over several
# commands: `setup` copies the code to /tmp/run, and later stages run from there. vLLM's offline
# bundle (the peer, `benchmarks.vllm_peer`) arrives in pieces in folders `.vb0/`, `.vb1/`, ... beside
# the code, each small enough to travel with the tree (a piece of 24.5 MB passed beside a 39.8 MB tree
# and 2.4 MB of wheels, one of 26.8 MB did not: keep piece + tree + wheels well under 64 MiB, and cut
# the pieces again as the tree grows, e.g. `split -b 20000000 -d -a 2 bundle.txz vllm026.txz.`, names
# that sort in order under `vllm026.txz.*`); `piece` moves the
# ones present to /tmp/pc, and the `vllm` stages unpack them once all are there. The stages and settings behind a result folder are in its COMMIT file, where it has
# one (benchmarks/results/README.md lists the folders).
#
# `.run` is `git archive HEAD` of the commit measured, plus `.whl/` (megatron-core 0.19.2, which
# the device image lacks); it is copied to /tmp/run so later commands need not bring it again. Results are
# kept under /tmp/res (the vLLM stage reads our runs back with `benchmarks.rollout --resume`) and
# copied to $OUT.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:/tmp/run
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p /tmp/pc /tmp/res
bench() { python3 -m benchmarks.rollout --no-progress "$@"; }

for stage in "$@"; do
  case "$stage" in
    setup)  # code to /tmp/run, megatron-core to /tmp/site
      rm -rf /tmp/run && cp -r "$(dirname "$0")/../.." /tmp/run
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/run/.whl/*.whl
      for d in .vb*; do [ -d "$d" ] && mv "$d"/* /tmp/pc/; done
      nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm,clocks.mem --format=csv
      git -C /tmp/run log -1 --format=%H 2>/dev/null || cat /tmp/run/COMMIT 2>/dev/null ;;
    piece)  # the pieces of the vLLM bundle present now
      for d in .vb*; do [ -d "$d" ] && mv "$d"/* /tmp/pc/; done; ls -l /tmp/pc ;;
    tests)  # every GPU-marked test (280 s no longer covered them all on 2026-12-04)
      cd /tmp/run
      timeout 560 python3 -m pytest -q -m gpu tests -p no:cacheprovider --timeout 120 -rf 2>&1 \
        | tee "$OUT/gpu_tests.log" | tail -15 ;;
    verify)  # speculative decoding's verify attention: rows alone against runs (benchmarks.attention --verify),
      # the plain decode shapes beside them, and the GPU tests of the kernels, runner and drafting engine
      cd /tmp/run
      timeout 240 python3 -m pytest -q -m gpu tests/kernels/test_attention.py tests/kernels/test_cuda_runner.py tests/runner/test_speculative.py \
        tests/benchmarks/test_attention_bench.py tests/engine -p no:cacheprovider --timeout 120 -rf 2>&1 \
        | tee "$OUT/gpu_tests.log" | tail -6
      # (VERIFY_GRID: the runs' launch settings to sweep, `TritonAttention.verify_*`; '' for none)
      timeout 240 python3 -m benchmarks.attention --prefill '' --backends triton --block-n '' \
        --decode "${DECODE_SHAPES:-64x(2047+1),128x(4095+1),12x(16383+1)}" --verify-block-n "${VERIFY_GRID-32,64,128}" \
        --verify-stages 2,3 --verify-warps 4,8 --verify-programs 2,4,8 --out "$OUT/attention-verify.json" 2>&1 | tail -8
      python3 -c "import json; d = json.load(open('$OUT/attention-verify.json')); print(json.dumps(d.get('best_verify')))
for s, v in d.get('verify', {}).items(): print(s, sorted((round(x['ms'] * 1e3, 1), n) for n, x in v['variants'].items())[:4])" ;;
    partition)  # SMs held back from prefill (`RunnerConfig.decode_sms`): its GPU tests, where P's kernels land,
      # and the stand-in P/D pair with P on a partition and D on an ordinary stream beside the other methods
      cd /tmp/run
      # (also the GPU tests of fixes not yet run on a GPU: the spawned one-GPU world, a failed capture's RNG,
      # the allocator counters)
      timeout 300 python3 -m pytest -q -m gpu tests/runner/test_partition.py tests/benchmarks/test_pd_overlap.py \
        tests/kernels/test_cuda_runner.py tests/comm/test_alltoall.py tests/engine/test_samples_gpu.py \
        tests/benchmarks/test_rollout.py \
        -p no:cacheprovider --timeout 120 -rf 2>&1 | tee "$OUT/gpu_tests.log" | tail -6
      timeout 60 python3 -m benchmarks.sm_partition --splits "${SPLITS:-116/16,108/24}" --methods driver,held --no-copy \
        --out "$OUT" > /dev/null 2>&1; python3 -c "import json; [print({k: p[k] for k in p if k != 'sm_ids'})
for p in json.load(open('$OUT/sm_partition.json'))['probes']]"
      timeout 240 python3 -m benchmarks.pd_overlap --method streams,driver,held --splits "${SPLITS:-116/16,108/24}" \
        --time-limit-s 200 --out "$OUT" 2>&1 | grep -E "gain|error|stopped" | tail -12
      cp "$OUT/pd_overlap.json" /tmp/res/ 2>/dev/null ;;  # for `interleave`'s simulator check of '/sms:N', '/split:N'
    hotswap)  # update_weights at full size: copy, bind, reshard
      cd /tmp/run
      timeout 100 python3 -m benchmarks.hotswap --model qwen3-30b-a3b --json \
        > "$OUT/hotswap.json" 2> "$OUT/hotswap.err"; tail -c 1200 "$OUT/hotswap.json"; tail -3 "$OUT/hotswap.err" ;;
    sleepwake)  # memory handed back: sleep/wake every tag at full size, graphs replayed and tokens kept after it
      cd /tmp/run
      timeout 400 python3 -m benchmarks.sleep_wake --out "$OUT" > /tmp/res/sleep_wake.log 2> /tmp/res/sleep_wake.err
      grep -E "cycle|built" /tmp/res/sleep_wake.err | tail -5; grep '"ok"' "$OUT/sleep_wake.json" ;;
    current)  # our schedules: budget sweep, then 3 interleaved warm repeats
      cd /tmp/run
      bench --profile current --schedules "${SCHEDULES:-off,chunked,mux}" ${ABLATION:---ablation} --repeats 3 \
        --no-vllm --deadline-s "${DEADLINE:-200}" --out /tmp/res/current > /tmp/res/current.log 2>&1
      tail -16 /tmp/res/current.log; cp /tmp/res/current/rollout.json "$OUT/current.json" ;;
    sampled)  # temperature 1 (seeded per turn): the device draw and decode ahead on sampled rows; ours only
      cd /tmp/run
      bench --profile current --schedules off,off/sync,mux,mux/sync --no-ablation --budgets "${BUDGETS:-4096}" \
        --temperature 1 --repeats 3 --no-vllm --deadline-s "${DEADLINE:-200}" --out /tmp/res/sampled \
        > /tmp/res/sampled.log 2>&1
      tail -16 /tmp/res/sampled.log; cp /tmp/res/sampled/rollout.json "$OUT/sampled.json" ;;
    sampled-drafts)  # temperature 1 on the prefill trace: chunked with and without n-gram drafts (at 99546c8 drafting
      # took 1.41x with no draft proposed, every sampled row read to the host alone, 2026-12-05-chunked-drafts-h100;
      # at 97acfda, rows decided at once, 1.14x, 2026-12-06-h200-drafts-48l; with its undrafted steps decoded
      # ahead 1.037x, /sync 1.141x, 2026-12-06-h200-ahead-drawn-48l: `auto` decodes them ahead since), drafting
      # with decode ahead and without (/sync); then the verdicts' host time row by row and at once; first the GPU
      # tests of the batched verifier and of drafting with decode ahead
      cd /tmp/run
      timeout 200 python3 -m pytest -q -m gpu tests/engine/test_speculative.py tests/engine/test_drafting_ngram.py \
        tests/runner/test_speculative.py -p no:cacheprovider -rf 2>&1 | tail -3
      bench --profile prefill --conversations "${CONV:-64}" --budgets 16384 --decode-ahead on \
        --schedules "${SCHEDULES:-chunked,chunked~ngram:7,chunked~ngram:7/sync}" \
        --temperature 1 --no-ablation --repeats "${REPEATS:-3}" --no-vllm --deadline-s "${DEADLINE:-420}" \
        --schedule-budget-s 150 ${EXTRA:-} --out /tmp/res/t1 > /tmp/res/t1.log 2>&1
      tail -12 /tmp/res/t1.log; cp /tmp/res/t1/rollout.json "$OUT/t1.json"
      timeout 90 python3 -m benchmarks.host --rows '' --fill '' --verify-fill '' --layout '' --turn-layout '' --append '' \
        --sample 16,64 --lookup '' --drafting '' --verdicts 16x0,64x0,64x4,64x7 --device cuda \
        > "$OUT/verdicts-cuda.json"  # (--sample: ours at temperature 1 against greedy and vLLM's unseeded noise race)
      python3 -c "import json; d = json.load(open('$OUT/verdicts-cuda.json'))
[print(s, k, {a: round(b['median'], 3) for a, b in v.items()}) for s in ('verdicts_ms', 'sample_ms') for k, v in d[s].items()]" ;;
    prefill)  # 16 conversations (24 did not fit 3 repeats in one command); the sweep and the ablation
      cd /tmp/run
      bench --profile prefill --conversations 16 --budgets "${BUDGETS:-2048,4096,8192,16384}" ${ABLATION:---ablation} \
        --repeats 3 --no-vllm --deadline-s "${DEADLINE:-300}" --out /tmp/res/prefill > /tmp/res/prefill.log 2>&1
      tail -16 /tmp/res/prefill.log; cp /tmp/res/prefill/rollout.json "$OUT/prefill.json" ;;
    policy64|policy128)  # the engine's priorities on prefill (64 or 128 conversations): interleaved repeats, plots
      cd /tmp/run
      n=${stage#policy}
      specs="chunked,mux,chunked+most-turns,mux+most-turns"
      [ "$n" = 64 ] && specs="$specs,chunked+longest-context,mux+longest-context"
      bench --profile prefill --conversations "$n" --budgets "${BUDGETS:-8192}" --schedules "${SCHEDULES:-$specs}" \
        --no-ablation --repeats 2 --no-vllm --deadline-s "${DEADLINE:-570}" --schedule-budget-s 90 \
        --out "/tmp/res/$stage" > "/tmp/res/$stage.log" 2>&1
      tail -24 "/tmp/res/$stage.log"; cp "/tmp/res/$stage/rollout.json" "$OUT/$stage.json"
      python3 -m benchmarks.plot "$OUT/$stage.json" "$OUT/$stage.png" ;;
    target)  # issue 33's targets on the prefill profile (CONV conversations, 64 by default): our schedules at
      # both budgets, 2 interleaved warm repeats, the breakdown in the JSON; the peer comes in `peer`;
      # EXTRA: more options (e.g. '--model qwen3-30b-a3b --trace-seed 1': before 2026-12-06 this stage dropped them)
      cd /tmp/run
      n=${CONV:-64}
      bench --profile prefill --conversations "$n" --budgets "${BUDGETS:-8192,16384}" \
        --schedules "${SCHEDULES:-off,chunked,mux,mux+longest-context}" --no-ablation --repeats 2 --no-vllm \
        --deadline-s "${DEADLINE:-560}" --schedule-budget-s 90 ${EXTRA:-} --out "/tmp/res/target$n" > "/tmp/res/target$n.log" 2>&1
      tail -24 "/tmp/res/target$n.log"; cp "/tmp/res/target$n/rollout.json" "$OUT/target$n.json"
      python3 -m benchmarks.plot "$OUT/target$n.json" "$OUT/target$n.png" ;;
    peer|peerin)  # vLLM on `target`'s trace (its folder in /tmp/res, or carried back as .res/targetN): `peer` at
      # its default, 8,192 and 16,384 with its core in its own process; `peerin` at its best of those with
      # the core in process (as RL frameworks colocate it); 2 warm-up passes, 2 timed; VLLM_WEIGHTS=dummy:
      # vLLM's own init (copy the run's folder first, e.g. inter64 to dummy64, as a --resume adds to its JSON);
      # VLLM_WEIGHTS=drawn: ours, drawn in its worker (48 layers: the file would not fit the disk)
      mkdir -p /tmp/pv/site
      [ -d /tmp/pv/site/vllm ] || (cat /tmp/pc/vllm026.txz.* | xz -dc -T8 | tar -x -C /tmp/pv/site)
      # (PEER_RUN names another of our runs in /tmp/res, e.g. drafts64)
      cd /tmp/run
      n=${CONV:-64}
      run=${PEER_RUN:-target$n}
      [ -d "/tmp/res/$run" ] || cp -r "$OLDPWD/.res/$run" /tmp/res/
      if [ "$stage" = peer ]; then modes="--vllm-budgets ${VLLM_BUDGETS:-default,8192,16384}"
      else modes="--vllm-budgets '' --vllm-in-process ${VLLM_INPROC:-best}"; fi
      eval bench --profile prefill --conversations "$n" --resume "/tmp/res/$run" --vllm --vllm-site /tmp/pv/site \
        $modes ${VLLM_SPEC:+--vllm-speculative $VLLM_SPEC} --vllm-weights "${VLLM_WEIGHTS:-ours}" --vllm-passes 2 --vllm-warmups 2 --deadline-s "${DEADLINE:-570}" --vllm-reserve-s "${DEADLINE:-570}" ${EXTRA:-} \
        > "/tmp/res/$stage$n.log" 2>&1
      tail -14 "/tmp/res/$stage$n.log"; cp "/tmp/res/$run/rollout.json" "$OUT/$run.json"
      cp /tmp/res/$run/vllm*.log "$OUT/" 2>/dev/null
      python3 -m benchmarks.plot "$OUT/$run.json" "$OUT/$run.png" ;;
    drafts)  # n-gram drafting under mux with FA3 for prefill attention (the unpacked bundle): plain mux, the
      # default wait budget and a 3x one (more prefill a round); vLLM after, with `PEER_RUN=drafts64 peer`.
      # (ran 2026-12-04: benchmarks/results/2026-12-04-verify-runs-fa3-h200; CONV and SCHEDULES override)
      mkdir -p /tmp/pv/site
      [ -d /tmp/pv/site/vllm ] || (cat /tmp/pc/vllm026.txz.* | xz -dc -T8 | tar -x -C /tmp/pv/site)
      cd /tmp/run
      n=${CONV:-64}
      PYTHONPATH=/tmp/site:/tmp/run:/tmp/pv/site bench --profile prefill --conversations "$n" --attention flash \
        --budgets "${BUDGETS:-16384}" --schedules "${SCHEDULES:-mux,mux~ngram:4,mux@budget:24000~ngram:4}" \
        --no-ablation --repeats 2 --no-vllm --deadline-s "${DEADLINE:-450}" --schedule-budget-s 90 ${EXTRA:-} \
        --out "/tmp/res/drafts$n" > "/tmp/res/drafts$n.log" 2>&1
      tail -20 "/tmp/res/drafts$n.log"; cp "/tmp/res/drafts$n/rollout.json" "$OUT/drafts$n.json"
      cp "/tmp/res/drafts$n/trace.jsonl" "$OUT/"
      python3 -m benchmarks.sim_replay "/tmp/res/drafts$n/rollout.json" --epoch-check 2>&1 | tail -16 ;;
    interleave)  # issue 33's comparison with the peer's timed passes interleaved with our repeats, both engines
      # up at once (benchmarks.interleave): CONV, SCHEDULES, REPEATS; VLLM_MODE own | in-process, VLLM_BUDGET,
      # VLLM_SPEC (its best setting: ngram:4 at 16,384; empty: none), HOST_PROFILE (schedules replayed once more under
      # cProfile); then the step times and the simulator's check (with `partition`'s stand-in factors when
      # that stage ran on this machine; EXTRA: more options, e.g. '--trace-seed 1', given to `peer`, `peerin` and
      # `drafts` alike when they add to or follow this run). The peer runs our weights (written to /tmp/res/$tag for it,
      # removed after; VLLM_WEIGHTS=dummy: its own dummy init; =drawn: ours drawn in its worker, no file) and counts its accepted drafts. Both engines hold their
      # memory at once: on an 80 GB H100 give each a 13 GiB KV cache (EXTRA='... --kv-gb 13'; 40 and 22 ran out).
      # EXTRA='--temperature 1 ...' samples in both engines (the peer unseeded; VLLM_SPEC='' for no drafts)
      mkdir -p /tmp/pv/site
      [ -d /tmp/pv/site/vllm ] || (cat /tmp/pc/vllm026.txz.* | xz -dc -T8 | tar -x -C /tmp/pv/site)
      cd /tmp/run
      n=${CONV:-64}; mode=${VLLM_MODE:-own}; tag=inter$n${mode#own}; reps=${REPEATS:-3}
      PYTHONPATH=/tmp/site:/tmp/run:/tmp/pv/site bench --profile prefill --conversations "$n" --attention flash \
        --budgets "${BUDGETS:-16384}" --schedules "${SCHEDULES:-off,chunked,mux,mux@budget:24000~ngram:4+7@4}" \
        --no-ablation --repeats "$reps" --vllm --vllm-site /tmp/pv/site --vllm-budgets "${VLLM_BUDGET:-16384}" \
        --vllm-speculative "${VLLM_SPEC-ngram:4}" --vllm-interleave "$mode" --vllm-passes "$reps" --vllm-warmups 2 \
        --vllm-weights "${VLLM_WEIGHTS:-ours}" ${HOST_PROFILE:+--host-profile "$HOST_PROFILE"} \
        --deadline-s "${DEADLINE:-570}" --schedule-budget-s 90 ${EXTRA:-} --out "/tmp/res/$tag" > "/tmp/res/$tag.log" 2>&1
      tail -22 "/tmp/res/$tag.log"; cp "/tmp/res/$tag/rollout.json" "$OUT/$tag.json"
      cp "/tmp/res/$tag/trace.jsonl" "$OUT/trace$n.jsonl"; cp /tmp/res/$tag/vllm*.log "$OUT/" 2>/dev/null
      python3 -c "import json; d = json.load(open('$OUT/$tag.json')); print(d.get('order'), d['vllm'].get('error'))"
      python3 -m benchmarks.step_times "$OUT/$tag.json" --out "$OUT/$tag.step_times.json" | tail -"$([ -n "${HOST_PROFILE:-}" ] && echo 32 || echo 12)"
      python3 -m benchmarks.sim_replay "$OUT/$tag.json" --trace "$OUT/trace$n.jsonl" --out "$OUT/$tag.sim_replay.json" \
        $([ -f /tmp/res/pd_overlap.json ] && echo --overlap-from /tmp/res/pd_overlap.json) --epoch-check \
        ${FIT_FROM:+--fit-from "$FIT_FROM"} 2>&1 | tail -20  # FIT_FROM: an earlier run with off and chunked
      python3 -m benchmarks.plot "$OUT/$tag.json" "$OUT/$tag.png" ;;
    splitrun)  # SM partitions in the engine's own rollout (issue 33's P/D overlap): plain and drafting mux on
      # the whole device and with 24 SMs held back from prefill (`/sms:24`, decode keeps every SM: 0.97 of
      # mux on two H100s on 2026-12-05, 1.03-1.05 of the drafting schedule; `/split:24`, decode on those
      # SMs alone beside prefill, was 1.036),
      # `chunked` for the simulator's out-of-sample fit; Triton attention, so no bundle is needed. First the
      # allocator-count test. CONV, SCHEDULES, REPEATS, DEADLINE; PD: the stand-in factors of this card
      cd /tmp/run
      timeout 120 python3 -m pytest -q -m gpu tests/benchmarks/test_rollout.py -k allocator -p no:cacheprovider \
        --timeout 100 -rf 2>&1 | tail -3
      n=${CONV:-64}
      bench --profile prefill --conversations "$n" --budgets 16384 --schedules "${SCHEDULES:-chunked,mux,mux/sms:24,\
mux@budget:24000~ngram:4+7@4,mux@budget:24000~ngram:4+7@4/sms:24}" --no-ablation --repeats "${REPEATS:-2}" \
        --no-vllm --deadline-s "${DEADLINE:-480}" --schedule-budget-s 90 --out "/tmp/res/split$n" > "/tmp/res/split$n.log" 2>&1
      tail -16 "/tmp/res/split$n.log"; cp "/tmp/res/split$n/rollout.json" "$OUT/split$n.json"
      python3 -c "import json; d = json.load(open('$OUT/split$n.json'))  # a failed capture on D's SMs moves D back
for k, e in d['schedules'].items(): r = (e.get('repeats') or [{}])[0]; print(k, {x: r.get(x) for x in (
    'capture_error', 'beside_capture_error', 'compilations', 'gc')})"
      cp "/tmp/res/split$n/trace.jsonl" "$OUT/split-trace$n.jsonl"
      python3 -m benchmarks.step_times "$OUT/split$n.json" --out "$OUT/split$n.step_times.json" | tail -12
      python3 -m benchmarks.sim_replay "$OUT/split$n.json" --trace "$OUT/split-trace$n.jsonl" \
        --overlap-from "${PD:-benchmarks/results/2026-12-04-pd-overlap-h200/pd_overlap.json}" 2>&1 | tail -8 ;;
    p48)  # the full 48-layer preset on the prefill profile: off and mux, one budget, one repeat
      cd /tmp/run
      bench --model qwen3-30b-a3b --profile prefill --conversations 6 --schedules off,mux --no-ablation \
        --budgets 2048 --repeats 1 --no-vllm --deadline-s 180 --out /tmp/res/p48 > /tmp/res/p48.log 2>&1
      tail -8 /tmp/res/p48.log; cp /tmp/res/p48/rollout.json "$OUT/p48.json" ;;
    profile)  # where a forward's time goes (torch profiler), eager against piecewise; PROFILE_SHAPES: other
      # forwards (e.g. a rollout's mixed step: 'mixed 48x(20000+1) + 1x(30000+16336)'), ATTN: the attention
      # (flash needs the unpacked bundle on PYTHONPATH)
      cd /tmp/run
      PYTHONPATH=$PYTHONPATH:/tmp/pv/site timeout 150 python3 -m benchmarks.profile --out "$OUT/profile.json" \
        ${PROFILE_SHAPES:+--shapes "$PROFILE_SHAPES"} --attention "${ATTN:-auto}" > /tmp/res/profile.log 2>&1
      grep __main__ /tmp/res/profile.log | cut -c1-200 ;;
    attention)  # attention backends and the Triton prefill settings grid on the model's shapes
      cd /tmp/run
      timeout 200 python3 -m benchmarks.attention --backends "${ATTN_BACKENDS:-triton,varlen}" \
        --out "$OUT/attention.json" 2>&1 | tail -8 ;;
    pages)  # KV page size against FA3's prefill and our decode kernels at a rollout's long contexts (prefill ran at
      # ~60% of the matmul rate on 2026-12-06, mostly attention): flash and triton at each block size in PAGES,
      # one process a size and round, the sizes interleaved over 3 rounds (pages-<size>-<round>.json); then
      # `interleave` with SCHEDULES='chunked,chunked/bs:64,...' times whole rollouts (and
      # EXTRA='... --vllm-block-size 64' the peer at the same page, vLLM's FA3 being the same kernel)
      mkdir -p /tmp/pv/site
      [ -d /tmp/pv/site/vllm ] || (cat /tmp/pc/vllm026.txz.* | xz -dc -T8 | tar -x -C /tmp/pv/site)
      cd /tmp/run
      for round in 1 2 3; do for bs in ${PAGES:-16 64 128}; do
        PYTHONPATH=$PYTHONPATH:/tmp/pv/site timeout 60 python3 -m benchmarks.attention --backends flash,triton \
          --block-n '' --block-size "$bs" --rounds 1 --prefill "${PAGE_PREFILL:-1x(30000+16384),4x(20000+4096),16x(8000+1024)}" \
          --decode "${PAGE_DECODE:-64x(20000+1),8x(40000+1),1x(60000+1)}" --verify '' \
          --out "$OUT/pages-$bs-$round.json" 2>&1 | tail -2
      done; done ;;
    fp8)  # bf16 vs FP8 (dense on scaled_mm; experts stacked e4m3 on the Triton kernels) in decode graphs
      cd /tmp/run
      timeout 300 python3 -m benchmarks.te --out "$OUT/fp8-bench.json" > /tmp/res/fp8.log 2>&1
      tail -8 /tmp/res/fp8.log ;;
    micro)  # the micro stage alone: decode steps, prefill rate, attention, experts
      cd /tmp/run
      timeout 120 python3 -m benchmarks.rollout --schedules '' --micro --no-vllm --out /tmp/res/micro \
        > /tmp/res/micro.log 2>&1; tail -12 /tmp/res/micro.log; cp /tmp/res/micro/rollout.json "$OUT/micro.json" ;;
    flash)  # FA3 from the unpacked vLLM bundle: its GPU tests, the attention grid with it (the crossover
      # shapes too), then a prefill replay on it
      cd /tmp/run
      PYTHONPATH=/tmp/site:/tmp/run:/tmp/pv/site timeout 120 python3 -m pytest -q -m gpu tests/kernels/test_attention.py \
        -k flash -p no:cacheprovider -rs 2>&1 | tee "$OUT/flash_tests.log" | tail -4
      PYTHONPATH=/tmp/site:/tmp/run:/tmp/pv/site timeout 150 python3 -m benchmarks.attention \
        --backends triton,flash --block-n 128 --stages 3 --warps 8 \
        --prefill '1x(0+4096),8x(2048+512),4x(2048+1024),1x(0+512),1x(0+1024),1x(0+2048),4x(0+512)' \
        --out "$OUT/attention-flash.json" 2>&1 | tail -8
      [ "${FLASH_REPLAY:-1}" = 0 ] && continue
      PYTHONPATH=/tmp/site:/tmp/run:/tmp/pv/site bench --profile prefill --conversations 16 --attention flash \
        --schedules "${SCHEDULES:-off,mux}" --no-ablation --budgets "${BUDGETS:-8192}" --repeats 3 --no-vllm \
        --deadline-s "${DEADLINE:-240}" --out /tmp/res/prefill-flash > /tmp/res/prefill-flash.log 2>&1
      tail -10 /tmp/res/prefill-flash.log; cp /tmp/res/prefill-flash/rollout.json "$OUT/prefill-flash.json" ;;
    kernels)  # fused small ops and the decode step; the micro stage (prefill rate, attention, experts)
      cd /tmp/run
      timeout 240 python3 -m benchmarks.kernels --json --out "$OUT/kernels.json" > /tmp/res/kernels.log 2>&1
      tail -40 /tmp/res/kernels.log | cut -c1-220
      timeout 100 python3 -m benchmarks.rollout --schedules '' --micro --no-vllm --out /tmp/res/micro \
        > /tmp/res/micro.log 2>&1; tail -12 /tmp/res/micro.log; cp /tmp/res/micro/rollout.json "$OUT/micro.json" ;;
    idle)  # the GPU's idle share of decode-only windows, 3 interleaved repeats, with and without decode ahead
      cd /tmp/run
      timeout 150 python3 -m benchmarks.profile --no-forwards --no-graphs --idle-rows "${IDLE_ROWS:-1,64}" \
        --idle-repeats 3 --out "$OUT/idle.json" > /tmp/res/idle.log 2>&1; grep -i "window" /tmp/res/idle.log | cut -c1-240 ;;
    flashmicro)  # the micro stage's decode and prefill with FA3 (the unpacked bundle) on every prefill
      mkdir -p /tmp/pv/site
      [ -d /tmp/pv/site/vllm ] || (cat /tmp/pc/vllm026.txz.* | xz -dc -T8 | tar -x -C /tmp/pv/site)
      cd /tmp/run
      PYTHONPATH=/tmp/site:/tmp/run:/tmp/pv/site timeout 150 python3 -m benchmarks.rollout --schedules '' \
        --micro --micro-parts decode,prefill --attention flash --no-vllm --out /tmp/res/micro-flash \
        > /tmp/res/micro-flash.log 2>&1; tail -12 /tmp/res/micro-flash.log | cut -c1-200
      cp /tmp/res/micro-flash/rollout.json "$OUT/micro-flash.json" ;;
    vllm|vllm48)  # unpack the bundle, then the peer on each profile's trace, against our runs
      mkdir -p /tmp/pv/site
      [ -d /tmp/pv/site/vllm ] || (cat /tmp/pc/vllm026.txz.* | xz -dc -T8 | tar -x -C /tmp/pv/site)
      cd /tmp/run
      if [ "$stage" = vllm ]; then runs=${VLLM_RUNS:-"current:default,best:270 prefill:default,best:290"}
      else runs="p48:default:200"; fi
      for r in $runs; do
        IFS=: read -r p b d <<< "$r"
        if [ "$p" = p48 ]; then
          opts="--model qwen3-30b-a3b --profile prefill --conversations 6 --vllm-passes 1"
        elif [ "$p" = prefill ]; then opts="--profile prefill --conversations 16"; else opts="--profile current"; fi
        bench $opts --resume "/tmp/res/$p" --vllm --vllm-site /tmp/pv/site --vllm-budgets "$b" \
          --deadline-s "$d" --vllm-reserve-s "$d" > "/tmp/res/$p.vllm.log" 2>&1
        tail -10 "/tmp/res/$p.vllm.log"; cp "/tmp/res/$p/rollout.json" "$OUT/$p.json"
        cp "/tmp/res/$p/vllm.log" "$OUT/$p.vllm.log" 2>/dev/null
      done ;;
    pdl)  # programmatic dependent launch (kernels.pdl): GPU tests with it on, then the 1-row decode idle
      # windows with it off and on, alternating processes (off, on, off, on)
      cd /tmp/run
      MEGATRON_ROLLOUT_PDL=1 timeout 100 python3 -m pytest -q -m gpu tests/kernels/test_cuda_runner.py \
        tests/kernels/test_pdl.py -p no:cacheprovider -x 2>&1 | tee "$OUT/pdl_tests.log" | tail -3
      for i in 1 2; do for v in 0 1; do
        MEGATRON_ROLLOUT_PDL=$v timeout 60 python3 -m benchmarks.profile --no-forwards --no-graphs \
          --idle-rows "${IDLE_ROWS:-1}" --idle-repeats 1 --out "$OUT/idle-pdl$v-$i.json" > "$OUT/idle-pdl$v-$i.log" 2>&1
        echo "PDL=$v round $i"; grep -i "window" "$OUT/idle-pdl$v-$i.log" | cut -c30-330
      done; done ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
