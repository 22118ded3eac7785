#!/usr/bin/env bash
# Checks the layering of src/pagedlm/ against PAGEDLM_LAYERS and PAGEDLM_HOST_LAYERS in
# CMakeLists.txt (the one place the layers are listed): a file of layer X may include headers of
# X and of the layers X uses, directly or transitively, never of a layer above it; a host layer
# holds no CUDA sources, includes no CUDA header and never tests PAGEDLM_HAS_CUDA. The CMake
# targets enforce the same order at link time, but every layer's include path is all of src/, so
# a header-only upward include would otherwise go unnoticed. A layer in PAGEDLM_LAYER_INTERFACES is
# included by the others through its one listed header. Prints each violation; exits 1 if any.
set -euo pipefail
cd "$(dirname "$0")/.."

# The quoted items of `set(NAME ...)` in CMakeLists.txt, one per line.
cmake_list() {
  awk -v name="$1" '$0 ~ "^set\\(" name "( |$)" { on = 1; sub("^set\\(" name, "") }
    on { sub("#.*", ""); print; if (/\)/) exit }' CMakeLists.txt |
    grep -oE '"[^"]*"|[a-z_]+' | tr -d '"'
}

declare -A deps=()
layers=()
while IFS= read -r entry; do
  layer=${entry%%:*}
  layers+=("$layer")
  deps[$layer]=${entry#*:}
done < <(cmake_list PAGEDLM_LAYERS | grep ':')
host_layers=" $(cmake_list PAGEDLM_HOST_LAYERS | tr '\n' ' ') "
[[ ${#layers[@]} -gt 0 ]] || { echo "check_layers: no PAGEDLM_LAYERS in CMakeLists.txt" >&2; exit 1; }

# allowed[X]: X and everything it reaches through deps.
declare -A allowed=()
for layer in "${layers[@]}"; do
  reach=" $layer " todo=${deps[$layer]}
  while [[ -n ${todo// /} ]]; do
    read -r next todo <<<"$todo"
    [[ -v deps[$next] ]] || { echo "check_layers: $layer uses unknown layer $next" >&2; exit 1; }
    [[ $reach == *" $next "* ]] && continue
    reach+="$next "
    todo+=" ${deps[$next]}"
  done
  allowed[$layer]=$reach
done

status=0
for dir in src/pagedlm/*/; do
  layer=$(basename "$dir")
  if [[ ! -v deps[$layer] ]]; then
    echo "src/pagedlm/$layer/: not a layer in PAGEDLM_LAYERS (CMakeLists.txt)"
    status=1
    continue
  fi
  while IFS=: read -r file line used; do
    if [[ ${allowed[$layer]} != *" $used "* ]]; then
      echo "$file:$line: layer $layer includes pagedlm/$used/, which is not below it"
      status=1
    fi
  done < <(grep -rnoE '^\s*#\s*include\s+"pagedlm/[a-z_]+/' "$dir" |
    sed -E 's|^([^:]*):([0-9]+):.*pagedlm/([a-z_]+)/$|\1:\2:\3|')
  if [[ $host_layers == *" $layer "* ]]; then
    while IFS= read -r hit; do
      echo "$hit: host layer $layer uses CUDA"
      status=1
    done < <(find "$dir" -name '*.cu' -o -name '*.cuh'
      grep -rnE '^\s*#\s*(include\s+<(cuda|cublas|curand|nvrtc)|.*PAGEDLM_HAS_CUDA)' "$dir" || true)
  fi
done
# A layer listed in PAGEDLM_LAYER_INTERFACES is reached from other layers through that header only.
while IFS= read -r entry; do
  layer=${entry%%:*}
  header=${entry#*:}
  header=${header// /}
  while IFS= read -r hit; do
    echo "$hit: includes pagedlm/$layer/ other than $header, the layer's one interface"
    status=1
  done < <(grep -rnE "^\s*#\s*include\s+\"pagedlm/$layer/" src/pagedlm --exclude-dir="$layer" |
    grep -vE "\"pagedlm/$layer/$header\"" || true)
done < <(cmake_list PAGEDLM_LAYER_INTERFACES)
[[ $status == 0 ]] && echo "check_layers: ${#layers[@]} layers, no upward includes"
exit $status
