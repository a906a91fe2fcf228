"""A tiny-moe replay on the CPU with 2M objects of ballast and 3,000 long-lived objects made per engine
step; prints the collections over 5 ms, whether each began inside the makespan, whether the engine had
requests then (busy) or none (between turns: every open conversation in a tool wait), and whether the
engine held the collector's freeze then (frozen) or not (thawed).
Run: python gc_where.py off|on (EngineConfig.gc_freeze)."""
import gc
import sys
import time

from megatron_rollout.engine import EngineConfig, KVConfig, RolloutEngine
from megatron_rollout.model.config import PRESETS
from megatron_rollout.model.transformer import MoETransformer
from megatron_rollout.trace.make import make_trace
from megatron_rollout.trace.replay import replay

on = sys.argv[1] == "on"
ballast = [[i] for i in range(2_000_000)]
cfg = PRESETS["tiny-moe"]
model = MoETransformer(cfg).init_weights(0)
trace = make_trace(8, 0, 0.05, 0.2, profile="current")
engine = RolloutEngine(model, EngineConfig(kv=KVConfig(num_blocks=4096), gc_freeze=on))
events, began = [], {}


def collection(phase, info):
    if phase == "start":
        began.update(t=time.perf_counter(), busy=engine.has_work(), frozen=engine.gc_freeze.held)
    elif (took := time.perf_counter() - began["t"]) > 0.005:
        events.append((began["t"], took, info["generation"], began["busy"], began["frozen"]))


kept, step = [], engine.step


def churn():
    kept.extend([i] for i in range(3000))  # long-lived objects made during the rollout (records, results)
    return step()


engine.step = churn
gc.callbacks.append(collection)
t0 = time.perf_counter()
details = {}
report, outs = replay(engine, trace, vocab_size=cfg.vocab_size, progress=False, details=details)
end, t1, start = max(o.times.finish for o in outs), time.perf_counter(), details["start"]
print("on" if on else "off", "makespan", round(end - start, 2), "replay call", round(t1 - t0, 2))
for t, took, generation, busy, frozen in events:
    where = "inside" if start <= t <= end else ("after" if t > end else "before")
    print(f"  gen{generation} {took * 1e3:.0f} ms {where} at {t - start:+.2f}s, engine "
          f"{'busy' if busy else 'between turns'}, {'frozen' if frozen else 'thawed'}")
print(f"  after the replay: a full collection frees {gc.collect()} objects; "
      f"{'frozen' if gc.get_freeze_count() else 'nothing frozen'}")
