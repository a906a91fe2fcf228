#!/usr/bin/env bash
# Transformer Engine on the H200, as named stages run in order; a device machine that keeps /tmp
# between commands may run them over several commands. The bundle comes from
# benchmarks/device/te_bundle.sh as pieces .cb0/ .. .cb6/ (cuBLAS 13.6's libraries) and .te0/ ..
# .te5/ (TE) beside the code, a few at a time (docs/fp8-te.md):
#
#   bash benchmarks/device/te_session.sh piece              (as often as pieces arrive)
#   bash benchmarks/device/te_session.sh piece build check  (with the last piece)
#   bash benchmarks/device/te_session.sh tests bench
#   bash benchmarks/device/te_session.sh megatron           (with .whl/ beside the code)
#
# Stages (each fails loudly, naming the step, and exits non-zero):
#   piece  move the present .teN/* to /tmp/tc and .cbN/* to /tmp/cc. Once /tmp/cc holds every byte
#          that .cb0/cublas.manifest names, check the sha256 and unpack the cuBLAS libraries to
#          /tmp/cublas; from then on every stage preloads them (LD_PRELOAD below): TE's grouped experts
#          need cuBLASLt >= 13.4 (bf16) / 13.5 (FP8 current) / 13.6 (FP8 block) on Hopper, torch 2.11
#          brings 13.1. Without the .cbN pieces TE still runs, with the routed experts off TE.
#   build  reassemble /tmp/tc into /tmp/te, verify checksums, install ninja and the missing small deps,
#          build transformer-engine-torch from its sdist tree against the device's torch and nvidia
#          headers, install core + meta + built wheel into /tmp/te/site. Log: $OUT/te-build.log,
#          wall time per step: $OUT/te-build.json
#   check  import transformer_engine.pytorch, te.Linear bf16 and under each FP8 recipe, the cuBLASLt
#          version TE sees and which recipes GroupedLinear's device-split path takes: $OUT/te-check.json
#   tests  the GPU tests of tests/model/test_te_layers.py: $OUT/te-tests.log
#   bench  python -m benchmarks.te: $OUT/te-bench.json
#   megatron  with .whl/ present: a Megatron TE-spec GPTModel's training step, then update_weights into
#          the rollout and logits parity: $OUT/te-megatron.json
set -uo pipefail
OUT=${OUT:-/tmp/te-out}
TE=/tmp/te
SITE=$TE/site
VERSION=2.20.2
mkdir -p "$OUT" /tmp/tc /tmp/cc "$TE"
CUBLAS=/tmp/cublas/nvidia/cu13/lib
preload_cublas() { [ -f "$CUBLAS/libcublasLt.so.13" ] && export LD_PRELOAD=$CUBLAS/libcublasLt.so.13:$CUBLAS/libcublas.so.13; true; }
preload_cublas
export PYTHONUNBUFFERED=1 PATH=$TE/tools/bin:$PATH
export PYTHONPATH=$SITE:$TE/deps:$TE/tools:$PWD${PYTHONPATH:+:$PYTHONPATH}
TIMES=$OUT/te-build.json
echo "{}" > "$TIMES.tmp"
fail() { echo "te_session FAILED at: $*" | tee -a "$OUT/te-build.log" >&2; exit 1; }
timed() {  # timed NAME CMD...: run, append its wall time to te-build.json, fail loudly on error
  local name=$1; shift
  local t0; t0=$(date +%s.%N)
  echo "== $name: $*" >> "$OUT/te-build.log"
  "$@" >> "$OUT/te-build.log" 2>&1
  local rc=$?
  python3 - "$TIMES.tmp" "$name" "$t0" "$rc" <<'EOF'
import json, sys, time
path, name, t0, rc = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
d = json.load(open(path)); d[name] = {"s": round(time.time() - t0, 1), "rc": rc}
json.dump(d, open(path, "w"), indent=1)
EOF
  cp "$TIMES.tmp" "$TIMES"
  [ "$rc" = 0 ] || { tail -40 "$OUT/te-build.log"; fail "$name (exit $rc; full log in te-build.log)"; }
  echo "ok: $name"
}

# Headers the extension's sources include (directly or through torch's ATen/cuda headers).
HEADERS="cuda_runtime.h crt/host_config.h cuda.h cudaTypedefs.h cuda_fp8.h cublasLt.h cublas_v2.h cusparse.h
cusolverDn.h cudnn.h nccl.h nvrtc.h nvtx3/nvToolsExt.h nv/target"  # nv/target: CCCL (CUDA 13 keeps it in include/cccl)

probe() {  # print the toolchain and nvidia include dirs found; write the CPLUS_INCLUDE_PATH to use
  python3 - "$TE" "$HEADERS" <<'EOF'
import glob, importlib.metadata as md, os, shutil, subprocess, sys, sysconfig
te, headers = sys.argv[1], sys.argv[2].split()
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "python", sys.version.split()[0])
print("nvcc:", shutil.which("nvcc"), "| /usr/local/cuda:", os.path.isdir("/usr/local/cuda"))
for exe in ("c++", "g++", "ninja"):
    path = shutil.which(exe)
    ver = subprocess.run([path, "--version"], capture_output=True, text=True).stdout.splitlines()[:1] if path else None
    print(f"{exe}: {path} {ver}")
print("Python.h:", os.path.isfile(os.path.join(sysconfig.get_paths()["include"], "Python.h")))
for dist in ("nvidia-cuda-runtime", "nvidia-cuda-runtime-cu13", "nvidia-cudnn-cu13", "nvidia-nccl-cu13",
             "nvidia-cublas", "nvidia-cuda-crt", "wheel", "setuptools"):
    try:
        print(f"{dist}: {md.version(dist)}")
    except md.PackageNotFoundError:
        print(f"{dist}: -")
import nvidia
roots = [p for p in nvidia.__path__]
dirs = sorted({d for r in roots for d in glob.glob(os.path.join(r, "*", "include"))})
cuda = os.environ.get("CUDA_HOME", "/usr/local/cuda")  # CCCL: the wheels' include/ lacks it, the toolkit has it
dirs += [d for r in roots for d in glob.glob(os.path.join(r, "*", "include", "cccl"))]
dirs += [d for d in (os.path.join(cuda, "include", "cccl"), os.path.join(cuda, "include")) if os.path.isdir(d)]
print("nvidia include dirs:", *dirs, sep="\n  ")
fallback = os.path.join(te, "hdr", "nvidia", "cu13", "include")
found, missing = {}, []
for h in headers:
    hit = next((d for d in dirs if os.path.isfile(os.path.join(d, h))), None)
    if hit is None and os.path.isfile(os.path.join(fallback, h)):
        hit = fallback + " (carried fallback)"
    found[h] = hit
    if hit is None:
        missing.append(h)
for h, d in found.items():
    print(f"  {h:<22} {d}")
if missing:
    print("MISSING headers (the build would stop at #include <...>):", " ".join(missing))
    sys.exit(3)
paths = dirs + ([fallback] if any("fallback" in (d or "") for d in found.values()) else [])
open(os.path.join(te, "include_path"), "w").write(":".join(paths))
EOF
}

install_missing_deps() {  # the bundle's small deps, only those this python cannot import already
  local want=() w mod
  declare -A MOD=([einops]=einops [onnxscript]=onnxscript [onnx]=onnx [onnx_ir]=onnx_ir [ml_dtypes]=ml_dtypes
    [protobuf]=google.protobuf [pydantic]=pydantic [pydantic_core]=pydantic_core [annotated_types]=annotated_types
    [typing_inspection]=typing_inspection [typing_extensions]=typing_extensions [nvdlfw_inspect]=nvdlfw_inspect
    [pyyaml]=yaml [importlib_metadata]=importlib_metadata [zipp]=zipp [lazy_importer]=lazy_importer)
  for w in "$TE"/b/te/wheels/deps/*.whl; do
    mod=${MOD[$(basename "$w" | cut -d- -f1)]:-}
    [ -n "$mod" ] || { echo "no import name for $w"; return 1; }
    python3 -c "import $mod" 2>/dev/null && echo "present: $mod" || { echo "install: $mod"; want+=("$w"); }
  done
  [ ${#want[@]} = 0 ] || python3 -m pip install -q --no-index --no-deps --no-compile --target "$TE/deps" "${want[@]}"
}

unpack_cublas() {  # once every piece named by cublas.manifest is in /tmp/cc: verify, unpack, preload
  local m=/tmp/cc/cublas.manifest name version size sha have
  [ -f "$m" ] && [ ! -f "$CUBLAS/libcublasLt.so.13" ] || return 0
  read -r name version size sha < "$m"
  have=$(cat /tmp/cc/cublas.txz.[0-9]* 2>/dev/null | wc -c)
  [ "$have" = "$size" ] || { echo "cublas: $have of $size bytes here; waiting for more pieces"; return 0; }
  cat /tmp/cc/cublas.txz.[0-9]* > /tmp/cc/cublas.txz && rm -f /tmp/cc/cublas.txz.[0-9]*
  echo "$sha  /tmp/cc/cublas.txz" | sha256sum -c --quiet || fail "cublas: sha256 of the reassembled pieces"
  mkdir -p /tmp/cublas && xz -dc -T8 /tmp/cc/cublas.txz | tar -x -C /tmp/cublas || fail "cublas: unpacking"
  rm -f /tmp/cc/cublas.txz
  preload_cublas
  python3 -c "import ctypes; print('$name $version: cuBLASLt', ctypes.CDLL('libcublasLt.so.13').cublasLtGetVersion())" \
    || fail "cublas: loading $CUBLAS/libcublasLt.so.13"
}

build_wheel() {
  local src=$TE/b/te/src/transformer_engine_torch-$VERSION
  rm -rf "$TE/build" "$TE/whl" && cp -r "$src" "$TE/build"  # setup.py deletes its own headers after a build
  (cd "$TE/build" && env CPLUS_INCLUDE_PATH="$(cat "$TE/include_path")${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}" \
    MAX_JOBS=${MAX_JOBS:-16} NVTE_FRAMEWORK=pytorch NVTE_BUILD_USE_NVIDIA_WHEELS=1 NVTE_PYTORCH_FORCE_BUILD=TRUE \
    NVTE_NO_LOCAL_VERSION=1 NVTE_WITH_NCCL_EP=${NVTE_WITH_NCCL_EP:-0} NVTE_CUDA_ARCHS=${NVTE_CUDA_ARCHS:-90} \
    python3 -m pip wheel --no-build-isolation --no-deps --no-index -v -w "$TE/whl" .)
}

for stage in "$@"; do
  case "$stage" in
    piece)
      n=0
      for d in .te[0-9]* .cb[0-9]*; do
        [ -d "$d" ] && [ -n "$(ls -A "$d")" ] || continue  # emptied by an earlier command on this machine
        case "$d" in .te*) mv "$d"/* /tmp/tc/ ;; *) mv "$d"/* /tmp/cc/ ;; esac
        n=$((n + 1))
      done
      [ "$n" -gt 0 ] || fail "piece: no .teN or .cbN folder beside the code"
      ls -l /tmp/tc /tmp/cc
      unpack_cublas ;;
    build)
      : > "$OUT/te-build.log"
      if [ ! -f "$TE/b/te/MANIFEST.sha256" ]; then
        rm -rf "$TE/b" && mkdir -p "$TE/b"
        timed reassemble bash -c "cat /tmp/tc/te.tar.* | tar -x -C $TE/b"
      fi
      timed checksums bash -c "cd $TE/b/te && sha256sum -c --quiet MANIFEST.sha256"
      timed ninja python3 -m pip install -q --no-index --no-deps --no-compile --target "$TE/tools" \
        "$TE"/b/te/wheels/tools/ninja-*.whl
      timed deps install_missing_deps
      rm -rf "$TE/hdr" && mkdir -p "$TE/hdr"
      for w in "$TE"/b/te/wheels/headers/*.whl; do python3 -m zipfile -e "$w" "$TE/hdr"; done
      timed probe probe
      timed build_torch_extension build_wheel
      timed install python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" \
        "$TE"/b/te/wheels/core/*.whl "$TE"/whl/transformer_engine_torch-*.whl
      ls -l "$TE"/whl "$SITE"/transformer_engine/wheel_lib | tee -a "$OUT/te-build.log"
      grep -E "^(torch|nvcc|c\+\+|g\+\+|ninja|Python.h|nvidia-|  )" "$OUT/te-build.log" | head -40
      cat "$TIMES" ;;
    check)
      python3 - "$OUT/te-check.json" <<'EOF' 2>&1 | tee "$OUT/te-check.log"
import json, sys, time, traceback
out = {"steps": {}}
def step(name, fn):
    t0 = time.time()
    try:
        out["steps"][name] = {"ok": True, "value": fn(), "s": round(time.time() - t0, 2)}
    except Exception as exc:
        out["steps"][name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2000:]}
    print(name, json.dumps(out["steps"][name])[:600])
import torch, torch.nn.functional as F
step("import", lambda: __import__("transformer_engine.pytorch").pytorch.__file__)
if not out["steps"]["import"]["ok"]:
    json.dump(out, open(sys.argv[1], "w"), indent=1, default=str)
    sys.exit(1)
import transformer_engine.pytorch as te
from transformer_engine.common import recipe as r
from megatron_rollout.model.te_layers import te_versions
out["versions"] = te_versions()
import transformer_engine_torch as tex
out["cublasLt"] = tex.get_cublasLt_version(); out["cudnn"] = tex.get_cudnn_version()
lin = te.Linear(2048, 4096, bias=False, params_dtype=torch.bfloat16, device="cuda")
x = torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16)
ref = F.linear(x.float(), lin.weight.float())
rel = lambda y: float((y.float() - ref).norm() / ref.norm())
def bf16():
    with torch.no_grad():
        return {"rel_err": rel(lin(x))}
step("linear_bf16", bf16)
recipes = {"delayed": lambda: r.DelayedScaling(fp8_format=r.Format.E4M3), "current": r.Float8CurrentScaling,
           "block": r.Float8BlockScaling}
for name, make in recipes.items():
    def run(make=make):
        with torch.no_grad(), te.autocast(enabled=True, recipe=make()):
            lin(x); return {"rel_err": rel(lin(x))}
    step(f"linear_fp8_{name}", run)
from transformer_engine.pytorch.module import grouped_linear as gl
out["grouped_tensor_path"] = {name: bool(gl.is_module_grouped_tensor_path_supported(make(), torch.bfloat16))
                              for name, make in recipes.items()}
out["grouped_tensor_path"]["bf16"] = bool(gl.is_module_grouped_tensor_path_supported(None, torch.bfloat16))
out["fp8_available"] = te.is_fp8_available(return_reason=True)
out["block_available"] = te.is_fp8_block_scaling_available(return_reason=True)
json.dump(out, open(sys.argv[1], "w"), indent=1, default=str)
sys.exit(0 if out["steps"]["import"]["ok"] and out["steps"]["linear_bf16"]["ok"] else 1)
EOF
      [ "${PIPESTATUS[0]}" = 0 ] || fail "check (see te-check.json)" ;;
    tests)
      timeout 300 python3 -m pytest -q -m gpu tests/model/test_te_layers.py -p no:cacheprovider --timeout 240 -rA -s \
        2>&1 | tee "$OUT/te-tests.log" | tail -25 ;;
    bench)
      timeout 400 python3 -m benchmarks.te --out "$OUT/te-bench.json" 2>&1 | tail -30 ;;
    megatron)  # .whl/ present: megatron-core 0.19.2 to /tmp/te/mcore; TE-spec trainer step -> rollout parity
      ls .whl/megatron_core-*.whl > /dev/null 2>&1 || fail "megatron: no .whl/megatron_core-*.whl: put the wheel in .whl/ beside the code"
      python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$TE/mcore" \
        .whl/megatron_core-*.whl || fail "megatron: pip install of the megatron-core wheel"
      export PYTHONPATH=$TE/mcore:$PYTHONPATH
      timeout 300 python3 -m benchmarks.te_megatron --out "$OUT/te-megatron.json" 2>&1 \
        | tee "$OUT/te-megatron.log" | tail -12
      timeout 200 python3 -m pytest -q -m gpu tests/model/test_te_megatron.py -p no:cacheprovider --timeout 180 -rA -s \
        2>&1 | tee "$OUT/te-megatron-tests.log" | tail -15 ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
