#!/usr/bin/env bash
# Transformer Engine on the H200, in stages, each in a `device` call made right after the previous
# one (the machine stays warm ~30 s idle, and /tmp with it). The bundle comes from
# examples/te_bundle.sh as pieces .te0/ ... .te4/, one per call (docs/te.md):
#
#   calls 1-4, carry [".te0"] .. [".te3"]: bash examples/te_session.sh piece
#   call 5,    carry [".te4"]:             bash examples/te_session.sh piece build
#   call 6,    no carry:                   bash examples/te_session.sh check tests
#   call 7,    no carry:                   bash examples/te_session.sh bench
#
# Stages (each fails loudly, naming the step, and exits non-zero):
#   piece  move this call's .teN/* to /tmp/tc
#   build  reassemble /tmp/tc into /tmp/te, verify checksums, install ninja and the missing small deps,
#          build transformer-engine-torch from its sdist tree against the device's torch and nvidia
#          headers, install core + meta + built wheel into /tmp/te/site. Log: $OUT/te-build.log,
#          wall time per step: $OUT/te-build.json
#   check  import transformer_engine.pytorch, te.Linear bf16 and under each FP8 recipe: $OUT/te-check.json
#   tests  the GPU tests of tests/model/test_te_layers.py: $OUT/te-tests.log
#   bench  python -m megatron_rollout.bench.te: $OUT/te-bench.json
#   cublas (prepared 2026-12-01, not yet run) move this call's .cbN/* (nvidia-cublas 13.4.3.11's
#          libraries, xz pieces of 49.6 MB) to /tmp/cc; once the last piece is there, unpack them to
#          /tmp/cublas and print cuBLASLt's version. Every later stage of the session then preloads
#          them (LD_PRELOAD below): TE's grouped experts need cuBLASLt >= 13.4, the image has 13.1.
#          Pieces: pip download --no-deps nvidia-cublas==13.4.3.11, unzip, then
#          tar -C <unzipped> -cf - . | xz -6 -T2 | split -b 49600000 -d - cublas134.txz. (one per .cbN/)
set -uo pipefail
OUT=${OUT:-/tmp/te-out}
TE=/tmp/te
SITE=$TE/site
VERSION=2.20.2
mkdir -p "$OUT" /tmp/tc /tmp/cc "$TE"
CUBLAS=/tmp/cublas/nvidia/cu13/lib
[ -f "$CUBLAS/libcublasLt.so.13" ] && export LD_PRELOAD=$CUBLAS/libcublasLt.so.13:$CUBLAS/libcublas.so.13${LD_PRELOAD:+:$LD_PRELOAD}
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
      for d in .te[0-9]*; do [ -d "$d" ] && mv "$d"/* /tmp/tc/ && n=$((n + 1)); done
      [ "$n" -gt 0 ] || fail "piece: no .teN folder in this call's carry"
      ls -l /tmp/tc ;;
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
      timeout 400 python3 -m megatron_rollout.bench.te --out "$OUT/te-bench.json" 2>&1 | tail -30 ;;
    megatron)  # carry [".whl"]: megatron-core 0.19.2 to /tmp/te/mcore; TE-spec trainer step -> rollout parity
      ls .whl/megatron_core-*.whl > /dev/null 2>&1 || fail "megatron: no .whl/megatron_core-*.whl: carry [\".whl\"]"
      python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$TE/mcore" \
        .whl/megatron_core-*.whl || fail "megatron: pip install of the megatron-core wheel"
      export PYTHONPATH=$TE/mcore:$PYTHONPATH
      timeout 300 python3 -m megatron_rollout.bench.te_megatron --out "$OUT/te-megatron.json" 2>&1 \
        | tee "$OUT/te-megatron.log" | tail -12
      timeout 200 python3 -m pytest -q -m gpu tests/model/test_te_megatron.py -p no:cacheprovider --timeout 180 -rA -s \
        2>&1 | tee "$OUT/te-megatron-tests.log" | tail -15 ;;
    cublas)
      for d in .cb[0-9]*; do [ -d "$d" ] && mv "$d"/* /tmp/cc/; done
      ls -l /tmp/cc
      if [ "${CUBLAS_LAST:-0}" = 1 ]; then
        mkdir -p /tmp/cublas && cat /tmp/cc/cublas134.txz.* | xz -dc -T8 | tar -x -C /tmp/cublas \
          || fail "cublas: unpacking /tmp/cc"
        LD_PRELOAD=$CUBLAS/libcublasLt.so.13 python3 -c "import ctypes; lt = ctypes.CDLL('libcublasLt.so.13'); \
print('cuBLASLt', lt.cublasLtGetVersion())" || fail "cublas: loading $CUBLAS/libcublasLt.so.13"
      fi ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
