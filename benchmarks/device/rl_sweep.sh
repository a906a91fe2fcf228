#!/usr/bin/env bash
# Seed sweeps of the GRPO main job on a many-core machine's CPUs (the GPU hidden), two configs at a
# time; every summary is merged into $OUT/sweep.json. Usage: rl_sweep.sh STEPS SEEDS NAME:ARGS...
# e.g. rl_sweep.sh 150 0-7 "base:" "mn:--draw multinomial" "lr5:--set lr=0.005"
set -u
steps=$1; seeds=$2; shift 2
export CUDA_VISIBLE_DEVICES="" PYTHONUNBUFFERED=1
jobs=$(( $(nproc) / 2 ))
run() { local name=${1%%:*} args=${1#*:}
  python3 benchmarks/rl_seeds.py --config configs/grpo_tool_cpu.yaml --seeds "$seeds" --steps "$steps" \
    --jobs "$jobs" --out "/tmp/sw/$name" $args > "/tmp/sw/$name.txt" 2>&1; tail -1 "/tmp/sw/$name.txt" | sed "s/^/$name: /"; }
mkdir -p /tmp/sw
while [ $# -gt 0 ]; do
  run "$1" & [ $# -gt 1 ] && { run "$2" & }; wait; shift; [ $# -gt 0 ] && shift
done
python3 - <<'PY'
import glob, json, os
out = {p.split("/")[-2]: json.load(open(p)) for p in glob.glob("/tmp/sw/*/summary.json")}
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "sweep.json"), "w"), indent=1)
for k, v in sorted(out.items()):
    print(k, v["learned"], "/", v["runs"], [r.get("delta", r.get("error")) for r in v["results"]])
PY
