# Shared by scripts/run and scripts/test: install what is missing, then configure and build.
# Sourced, not executed.

MOK_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MOK_BUILD=${MOK_BUILD:-$MOK_ROOT/build}
MOK_JOBS=${MOK_JOBS:-$(nproc 2>/dev/null || echo 2)}

log() { printf '[mok] %s\n' "$*" >&2; }

# Debian packages for the C++ build, installed only when something is missing.
ensure_system_packages() {
  local missing=()
  command -v cmake >/dev/null || missing+=(cmake)
  command -v ninja >/dev/null || missing+=(ninja-build)
  command -v g++ >/dev/null || missing+=(g++)
  command -v python3 >/dev/null || missing+=(python3)
  if [ ! -e /usr/include/gtest/gtest.h ] && [ ! -e /usr/local/include/gtest/gtest.h ]; then
    missing+=(libgtest-dev)
  fi
  [ ${#missing[@]} -eq 0 ] && return 0
  log "installing missing system packages: ${missing[*]}"
  local sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" \
    || { log "could not install ${missing[*]}; install them and retry"; return 1; }
}

# Release build into $MOK_BUILD. CUDA sources are compiled for sm_90a when nvcc is found.
build_mok() {
  local nvcc_dir=/usr/local/cuda/bin
  if ! command -v nvcc >/dev/null && [ -x "$nvcc_dir/nvcc" ]; then export PATH="$nvcc_dir:$PATH"; fi
  local gen=()
  command -v ninja >/dev/null && gen=(-G Ninja)
  if [ ! -f "$MOK_BUILD/CMakeCache.txt" ]; then
    cmake -S "$MOK_ROOT" -B "$MOK_BUILD" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release "$@" || return 1
  fi
  cmake --build "$MOK_BUILD" -j "$MOK_JOBS" || return 1
}
