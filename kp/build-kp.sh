#!/usr/bin/env bash
# Build kp 0.9.0 (Kompute) from its PyPI sdist with vkformers' patch, offline
# against Debian packages, and cache the wheel. Prints the wheel's path.
#   usage: kp/build-kp.sh PYTHON [CACHE_DIR]
# Needs: libvulkan-dev libfmt-dev pybind11-dev cmake g++, and wheel/setuptools/numpy in PYTHON's env.
set -euo pipefail
python=${1:?usage: build-kp.sh PYTHON [CACHE_DIR]}
here=$(cd "$(dirname "$0")" && pwd)
cache=${2:-${VKFORMERS_CACHE:-$HOME/.cache/vkformers}/kp}
patch_id=$(sha256sum "$here/vkformers.patch" | cut -c1-12)
tag=$("$python" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
out="$cache/$patch_id-$tag"
mkdir -p "$out"
wheel=$(ls "$out"/kp-*.whl 2>/dev/null | head -n1 || true)
if [[ -n $wheel ]]; then echo "$wheel"; exit 0; fi

work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
sdist="$cache/kp-0.9.0.tar.gz"
if [[ ! -f $sdist ]]; then
  "$python" -m pip download -q --no-deps --no-binary :all: kp==0.9.0 -d "$work" >&2
  mv "$work/kp-0.9.0.tar.gz" "$sdist"
fi
tar -C "$work" -xzf "$sdist"
(cd "$work/kp-0.9.0" && patch -p1 -s < "$here/vkformers.patch")
# Offline: use the system Vulkan headers, fmt and pybind11 instead of fetching them.
export KP_CMAKE_ARGS="-DKOMPUTE_OPT_USE_BUILT_IN_VULKAN_HEADER=OFF -DKOMPUTE_OPT_USE_BUILT_IN_FMT=OFF \
 -DKOMPUTE_OPT_USE_BUILT_IN_PYBIND11=OFF -DKOMPUTE_OPT_INSTALL=OFF -DKOMPUTE_OPT_DISABLE_VK_DEBUG_LAYERS=ON"
"$python" -m pip wheel -q --no-deps --no-build-isolation -w "$out" "$work/kp-0.9.0" >&2
ls "$out"/kp-*.whl
