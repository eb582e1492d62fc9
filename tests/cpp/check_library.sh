#!/usr/bin/env bash
# What the library's archives hold, checked on their symbols:
# - its arrows point one way (CMakeLists.txt): mok_core uses nothing of the backends or the API,
#   the backends nothing of each other or the API (undefined symbols, so an include or a call
#   across the line fails here even where CMake would not notice);
# - its kernels are the ones users run, without the test hooks: every grouped GEMM kernel is
#   instantiated without the stall hook and every megakernel with FusedNoHooks (the hooked ones
#   live in tests/cpp/support).
# usage: check_library.sh BUILD_DIR
set -u
dir="$1"
fails=0
# check ARCHIVE PATTERN WHAT: no undefined symbol of ARCHIVE matches PATTERN.
check() {
  local found
  found=$(nm -C --undefined-only "$dir/$1" 2>/dev/null | grep -E "$2" | sort -u)
  if [ -n "$found" ]; then
    echo "FAIL - $1 uses $3:"
    echo "$found" | head -10 | sed 's/^/  /'
    fails=$((fails + 1))
  else
    echo "ok   - $1 uses nothing of $3"
  fi
}
for a in libmok_core.a libmok_reference.a libmok_cuda.a libmok_api.a; do
  [ -f "$dir/$a" ] || { echo "FAIL - $dir/$a is missing"; exit 1; }
done
api='mok::(Workspace::|forward\(|backward\(|recompute_forward_context|backend_available|require_backend|resolve_backend|host_ep::)'
check libmok_core.a "mok::make_(cpu|cuda)_backend|mok::cuda::|mok::reference::|$api" \
  "the backends or the API"
check libmok_reference.a "mok::make_cuda_backend|mok::cuda::|$api" "the CUDA backend or the API"
check libmok_cuda.a "mok::make_cpu_backend|mok::reference::|$api" "the CPU reference or the API"
# hooks KIND PATTERN ALLOWED: every kernel of the library's archives matching PATTERN matches
# ALLOWED (its hook-free instantiation), and there is at least one.
hooks() {
  local all found
  all=$(for a in libmok_gemm.a libmok_cuda.a libmok_api.a libmok_core.a; do
    [ -f "$dir/$a" ] && nm -C "$dir/$a" 2>/dev/null
  done | grep -E "$2" | sort -u)
  found=$(echo "$all" | grep -vE "$3")
  if [ -z "$all" ]; then
    echo "FAIL - no $1 in the library (the check looks for the wrong names)"
    fails=$((fails + 1))
  elif [ -n "$found" ]; then
    echo "FAIL - the library holds a hooked $1:"
    echo "$found" | head -5 | sed 's/^/  /'
    fails=$((fails + 1))
  else
    echo "ok   - no hooked $1 in the library ($(echo "$all" | wc -l) symbols)"
  fi
}
if [ -f "$dir/libmok_gemm.a" ]; then
  hooks "grouped GEMM kernel" '[: ]sm90_grouped_gemm_kernel<' ', false>\(mok::gemm::GemmDescriptor, int, mok::gemm::Fp8Params\)'
  hooks "forward megakernel" '[: ]fused_forward_kernel<' 'fused_forward_kernel<(true|false), mok::cuda::FusedNoHooks>'
fi
echo "library: $fails failed"
[ $fails -eq 0 ]
