#!/usr/bin/env bash
# The library's arrows point one way (CMakeLists.txt): mok_core uses nothing of the backends or
# the API, the backends nothing of each other or the API. Checked on the archives' undefined
# symbols, so an include or a call across the line fails here even where CMake would not notice.
# usage: check_layers.sh BUILD_DIR
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
echo "layers: $fails failed"
[ $fails -eq 0 ]
