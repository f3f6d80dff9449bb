#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the test suite through tox on the default Vulkan device.
#   usage: bash scripts/test.sh [pytest args]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/scripts/setup.sh"
export VKFORMERS_KP_WHEEL=$(bash "$root/kp/build-kp.sh" "$root/.venv/bin/python")
cd "$root" && exec "$root/.venv/bin/tox" -q -- "$@"
