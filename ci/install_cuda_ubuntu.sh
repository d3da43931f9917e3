#!/usr/bin/env bash
# nvcc and the CUDA runtime headers on a hosted Ubuntu runner (no GPU needed to compile).
# Uses NVIDIA's apt repository; CUDA_VERSION like 13-0.
set -euo pipefail
CUDA_VERSION=${CUDA_VERSION:-13-0}
# shellcheck disable=SC1091  # the runner's own file
. /etc/os-release
repo="ubuntu${VERSION_ID//./}"
wget -q "https://developer.download.nvidia.com/compute/cuda/repos/${repo}/x86_64/cuda-keyring_1.1-1_all.deb"
sudo dpkg -i cuda-keyring_1.1-1_all.deb
sudo apt-get update -q
sudo apt-get install -y -q "cuda-nvcc-${CUDA_VERSION}" "cuda-cudart-dev-${CUDA_VERSION}" \
    "cuda-crt-${CUDA_VERSION}" "cuda-nvrtc-dev-${CUDA_VERSION}"
echo "/usr/local/cuda/bin" >> "${GITHUB_PATH:-/dev/null}"
echo "CUDA_HOME=/usr/local/cuda" >> "${GITHUB_ENV:-/dev/null}"
/usr/local/cuda/bin/nvcc --version
