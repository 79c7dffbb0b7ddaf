#!/usr/bin/env bash
# On the offline GPU host, in the project's root: `source .gpu/setup.sh`. Installs .gpu/ once into
# /tmp/bench-site (no index, no network) and exports what the suite needs to find it.
_bench_site=/tmp/bench-site
if [ ! -f "$_bench_site/.installed" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$_bench_site" .gpu/whl/*.whl || return 1
  if compgen -G ".gpu/extra/*.whl" > /dev/null; then  # Unsloth's, where they were carried
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$_bench_site" .gpu/extra/*.whl || return 1
  fi
  _bench_src=$(mktemp -d)
  tar xzf .gpu/deepspeed-*.tar.gz -C "$_bench_src" || return 1
  (cd "$_bench_src"/deepspeed-* && DS_BUILD_OPS=0 python3 -m pip install -q --no-index --no-deps --no-build-isolation \
     --target "$_bench_site" .) || return 1
  touch "$_bench_site/.installed"
fi
export PYTHONPATH="$PWD:$_bench_site${PYTHONPATH:+:$PYTHONPATH}" PATH="$_bench_site/bin:$PATH"
# DeepSpeed JIT-builds its Adam kernels on first use; CUDA 13 images need the arch given explicitly.
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" DS_SKIP_CUDA_CHECK=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
