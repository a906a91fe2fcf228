#!/usr/bin/env bash
# Transformer Engine 2.20.2 for the H200, bundled HERE (a CPU machine that reaches the package
# registry) and cut into pieces small enough to send to the GPU machine one at a time (docs/fp8-te.md; the device side is
# benchmarks/device/te_session.sh).
#
# What goes in (nothing is recompressed: the wheels are zips already; the pieces are `split` of one tar):
#   wheels/core/    transformer-engine-cu13 (core library + TE's PyTorch Python code, ~264 MiB) and the
#                   `transformer-engine` meta wheel (TE's import-time check wants its dist-info, same version)
#   wheels/tools/   ninja (torch's extension builder uses it when it is on PATH)
#   wheels/headers/ CUDA 13 runtime, crt and nvtx headers: used at build time only if the device's own
#                   nvidia wheels lack them (crt/ is a separate wheel in CUDA 13, not a torch dependency)
#   wheels/deps/    small Python deps TE's torch part imports at `import transformer_engine.pytorch`
#                   (einops, onnx/onnxscript: export.py imports onnx_extensions at module level; pydantic:
#                   common/recipe; nvdlfw-inspect: the debug API) and their own small deps; the device
#                   installs each one only when the device cannot import it already.
#   src/            transformer-engine-torch 2.20.2, the sdist's tree (33 .cpp files, C++ only).
# Assumed on the device (PLATFORM-NOTES.md): torch 2.11 cu130 with its nvidia-* CUDA 13 wheels (cuBLAS,
# cuDNN, NCCL, NVRTC, cuRAND, their headers), numpy, packaging, sympy, g++.
#
# Why the sdist is taken from pip's unpacked tree: `pip download` of an sdist runs its metadata hook,
# and TE-torch's setup.py parses `torch.version.cuda`, which is None with the CPU torch here. pip has
# downloaded and unpacked the sdist by then; `--no-clean` keeps that tree, which is the sdist's content.
#
# cuBLAS (part `cublas`): TE's grouped experts (GroupedLinear's device-split path) need cuBLASLt >= 13.4
# (bf16), 13.5 (FP8 current scaling), 13.6 (FP8 block scaling) on Hopper; torch 2.11's wheels bring
# 13.1. The part carries nvidia-cublas $CUBLAS_VERSION's two libraries (libcublas, libcublasLt: 572 MB,
# ~390 MB as xz) in pieces .cb0/ .cb1/ ..., with cublas.manifest (the stream's size and sha256) in .cb0/;
# te_session.sh's `piece` stage unpacks them once every byte is there, and its later stages preload them.
#
# Usage: bash benchmarks/device/te_bundle.sh [te] [cublas]   (from the repository root; default both; pieces land
#        in .te0/ .te1/ ... and .cb0/ .cb1/ ...)
# Env:   TE_BUNDLE_WORK=/tmp/te_bundle (scratch), TE_PIECE=55M (one piece plus the working tree must stay
#        under the 64 MiB the GPU machine accepts at once: the tree was 7.2 MB on 2026-12-01), CUBLAS_VERSION=13.6.2.16.
set -euo pipefail
VERSION=2.20.2
WORK=${TE_BUNDLE_WORK:-/tmp/te_bundle}
PIECE=${TE_PIECE:-55M}
CUBLAS_VERSION=${CUBLAS_VERSION:-13.6.2.16}
PARTS=${*:-te cublas}
ROOT=$(pwd)
[ -f "$ROOT/pyproject.toml" ] && [ -d "$ROOT/benchmarks/device" ] || { echo "te_bundle: run from the repository root" >&2; exit 2; }
step() { echo "== te_bundle: $*"; }
fail() { echo "te_bundle FAILED at: $*" >&2; exit 1; }

P=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
   --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
   --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64)
DEPS=(einops==0.8.2 onnxscript==0.7.2 onnx==1.23.2 onnx-ir==1.1.0 ml-dtypes==0.6.0 protobuf==7.36.2
      pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
      typing-extensions==4.16.0 nvdlfw-inspect==0.2.2 pyyaml==6.0.4 importlib-metadata==10.2.0
      zipp==4.1.2 lazy-importer==0.1.0)

te_part() {
  rm -rf "$WORK/te" "$WORK/tmp" "$WORK/sdist" && mkdir -p "$WORK/te/wheels"/{core,tools,headers,deps} "$WORK/te/src" "$WORK/tmp"
  B=$WORK/te/wheels
  step "core wheels"
  pip download -q "${P[@]}" -d "$B/core" "transformer-engine-cu13==$VERSION" "transformer-engine==$VERSION" \
    || fail "pip download transformer-engine-cu13 / transformer-engine $VERSION"
  step "ninja"
  pip download -q "${P[@]}" -d "$B/tools" ninja || fail "pip download ninja"
  step "CUDA 13 header wheels (fallback)"
  pip download -q "${P[@]}" -d "$B/headers" "nvidia-cuda-crt==13.0.*" "nvidia-cuda-runtime==13.0.*" "nvidia-nvtx==13.0.*" \
    || fail "pip download nvidia-cuda-crt / nvidia-cuda-runtime / nvidia-nvtx 13.0"
  step "small Python deps"
  pip download -q "${P[@]}" -d "$B/deps" "${DEPS[@]}" || fail "pip download ${DEPS[*]}"

  step "transformer-engine-torch $VERSION sdist"
  TMPDIR=$WORK/tmp pip download --no-clean --no-deps --no-binary :all: --no-build-isolation -d "$WORK/sdist" \
    "transformer-engine-torch==$VERSION" > "$WORK/sdist.log" 2>&1 || true  # the metadata hook fails here (above)
  tree=""
  if ls "$WORK"/sdist/transformer_engine_torch-"$VERSION".tar.gz >/dev/null 2>&1; then
    tar -xzf "$WORK"/sdist/transformer_engine_torch-"$VERSION".tar.gz -C "$WORK/tmp"
  fi
  for pkg in $(find "$WORK/tmp" -maxdepth 3 -name PKG-INFO); do
    d=$(dirname "$pkg")
    if grep -qx "Name: transformer_engine_torch" "$pkg" && grep -qx "Version: $VERSION" "$pkg" && [ -f "$d/setup.py" ]; then
      tree=$d; break
    fi
  done
  [ -n "$tree" ] || { tail -20 "$WORK/sdist.log" >&2; fail "no transformer_engine_torch $VERSION source tree from pip download"; }
  cp -r "$tree" "$WORK/te/src/transformer_engine_torch-$VERSION"
  find "$WORK/te/src" -name __pycache__ -prune -exec rm -rf {} +
  ncpp=$(find "$WORK/te/src" -name '*.cpp' | wc -l)
  ncu=$(find "$WORK/te/src" -name '*.cu' | wc -l)
  echo "sdist tree: $ncpp .cpp files, $ncu .cu files"

  step "manifest"
  (cd "$WORK/te" && find wheels -name '*.whl' | sort | xargs sha256sum > MANIFEST.sha256 \
    && echo "transformer_engine $VERSION; $ncpp .cpp, $ncu .cu in src/" > MANIFEST.txt)

  step "pieces of $PIECE"
  rm -rf "$ROOT"/.te[0-9]*
  tar -C "$WORK" -cf - te | split -b "$PIECE" -d -a 1 - "$WORK/te.tar."
  n=0
  for f in "$WORK"/te.tar.*; do
    mkdir -p "$ROOT/.te$n" && mv "$f" "$ROOT/.te$n/"
    n=$((n + 1))
  done
  total=$(du -cb "$ROOT"/.te[0-9]*/te.tar.* | tail -1 | cut -f1)
  ls -l "$ROOT"/.te[0-9]*/te.tar.*
  echo "te_bundle: $n pieces, $total bytes in all ($(du -sh "$WORK/te" | cut -f1) unpacked)"
}

cublas_part() {
  local w=$WORK/cublas
  rm -rf "$w" && mkdir -p "$w/whl" "$w/lib"
  step "nvidia-cublas $CUBLAS_VERSION"
  pip download -q "${P[@]}" -d "$w/whl" "nvidia-cublas==$CUBLAS_VERSION" || fail "pip download nvidia-cublas $CUBLAS_VERSION"
  (cd "$w/lib" && unzip -q "$w"/whl/nvidia_cublas-*.whl 'nvidia/cu13/lib/libcublas.so.13' \
    'nvidia/cu13/lib/libcublasLt.so.13' 'nvidia_cublas-*.dist-info/*') || fail "unzip nvidia-cublas"
  step "xz pieces of $PIECE"
  rm -rf "$ROOT"/.cb[0-9]*
  tar -C "$w/lib" -cf - . | xz -6 -T2 > "$w/cublas.txz"
  echo "nvidia-cublas $CUBLAS_VERSION $(stat -c %s "$w/cublas.txz") $(sha256sum "$w/cublas.txz" | cut -d' ' -f1)" \
    > "$w/cublas.manifest"
  split -b "$PIECE" -d -a 2 "$w/cublas.txz" "$w/cublas.txz."
  local n=0 f
  for f in "$w"/cublas.txz.[0-9]*; do
    mkdir -p "$ROOT/.cb$n" && mv "$f" "$ROOT/.cb$n/"
    n=$((n + 1))
  done
  cp "$w/cublas.manifest" "$ROOT/.cb0/"
  ls -l "$ROOT"/.cb[0-9]*/
  echo "te_bundle: cuBLAS in $n pieces: $(cat "$w/cublas.manifest")"
}

for part in $PARTS; do
  case "$part" in
    te) te_part ;;
    cublas) cublas_part ;;
    *) fail "unknown part $part (te, cublas)" ;;
  esac
done
