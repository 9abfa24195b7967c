#!/usr/bin/env bash
# A venv with llama.cpp's prebuilt CPU libraries (the llama-cpp-py-sync wheel, AVX2, cffi),
# made to load on Debian 12 (glibc 2.36; the wheel was linked against 2.38): its four
# __isoc23_* imports are unversioned and served by libisoc23.so (isoc23.c), and its need
# of GLIBC_2.38 is marked weak (weakver.py). Needs gcc and patchelf (apt-get install patchelf).
#
#   scripts/llamacpp_wheel/setup.sh [VENV]    # default /tmp/lcvenv; prints the venv's python
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
VENV="${1:-/tmp/lcvenv}"
VERSION="${LLAMA_CPP_PY_SYNC_VERSION:-0.11739}"
if [[ ! -x "$VENV/bin/python" ]]; then python3 -m venv "$VENV"; fi
"$VENV/bin/pip" install -q cffi numpy "llama-cpp-py-sync==$VERSION" >&2
D="$("$VENV/bin/python" -c 'import importlib.util as u; print(u.find_spec("llama_cpp_py_sync").submodule_search_locations[0])')"
if [[ ! -f "$D/libisoc23.so" ]]; then
  command -v patchelf >/dev/null || { apt-get install -y -qq patchelf >&2 || { apt-get update -qq && apt-get install -y -qq patchelf >&2; }; }
  gcc -O2 -shared -fPIC -o "$D/libisoc23.so" "$HERE/isoc23.c"
  for f in "$D"/lib*.so*; do
    [[ -L "$f" || "$(basename "$f")" == libisoc23.so ]] && continue
    syms="$(objdump -T "$f" | awk '/GLIBC_2\.38/ {print $NF}')"
    [[ -z "$syms" ]] && continue
    for s in $syms; do patchelf --clear-symbol-version "$s" "$f"; done
    patchelf --add-needed libisoc23.so "$f"
    patchelf --set-rpath '$ORIGIN' "$f"
    python3 "$HERE/weakver.py" "$f" >&2
  done
fi
"$VENV/bin/python" -c 'import llama_cpp_py_sync' && echo "$VENV/bin/python"
