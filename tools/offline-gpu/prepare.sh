#!/usr/bin/env bash
# For a GPU host without network (CUDA, torch, transformers, peft preinstalled; Python 3.12 x86_64):
# run here, in the project's root, on a machine that reaches PyPI. Fills .gpu/ (git-ignored) with the
# wheels such an image lacks (liger-kernel, bitsandbytes, torchao, galore-torch, apollo-torch,
# cut-cross-entropy, unsloth (in .gpu/extra/), and DeepSpeed's pure-Python dependencies; requests, urllib3, certifi and
# idna, which Unsloth's import needs, the image has),
# DeepSpeed's source archive, and setup.sh. Extra NAME==VERSION arguments are fetched as wheels too.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
mkdir -p .gpu/whl
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 any; do
  platforms+=(--platform "$tag")
done
download() {  # FOLDER NAME==VERSION...: wheels for the GPU host's Python 3.12 on x86_64
  local folder=$1; shift
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
    -d "$folder" "$@"
}
download .gpu/whl liger-kernel==0.8.5 bitsandbytes==0.50.2 torchao==0.18.0 galore-torch==1.0 apollo-torch==1.0.3 \
  cut-cross-entropy==25.1.1 hjson==3.1.0 pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 \
  typing-inspection==0.4.5 "$@"
# The GPU image's torch is 2.11.0+cu130: bitsandbytes' libraries for other CUDA releases, ROCm and Intel's XPU only
# make .gpu/whl too large to travel beside the project (a device call carries 64 MiB). CUDA 13.0's is kept alone:
# bitsandbytes 0.50 loads the highest library of the runtime's major release not above it, so an image on a later
# CUDA 13 still finds it (and says so in a warning)
python3 tools/offline-gpu/slim_wheel.py .gpu/whl/bitsandbytes-0.50.2-*.whl \
  'libbitsandbytes_(cuda1[12][0-9]|cuda13[1-9]|rocm[0-9]+|xpu[0-9]+)\.so$'
# Unsloth's two wheels (~30 MiB) apart, in .gpu/extra/: only the `unsloth` stacks need them, and the rest (~10 MiB
# slimmed) travels with a margin without them
download .gpu/extra unsloth==2026.10.9 unsloth_zoo==2026.10.9
python3 -m pip download -q --no-deps --no-binary=:all: -d .gpu deepspeed==0.19.8
cp tools/offline-gpu/setup.sh .gpu/setup.sh
du -sh .gpu .gpu/whl .gpu/extra
# what a GPU window's call would carry, tracked tree included, against the device's 64 MiB: fails here, not there
python3 tools/offline-gpu/travel_size.py
