#!/usr/bin/env bash
# `pip install --no-build-isolation --no-index .` as a user runs it (docs/packaging.md):
# a copy of the source tree is installed into a fresh virtual environment of Debian's
# python3 (--system-site-packages, so that Debian's numpy is seen), which builds the
# module from source with the project's CMake; then a 2-peer all-reduce runs with the
# installed package from a directory outside the source tree. The copy must come out
# of the install as it went in (setuptools' build and egg-info directories are elsewhere).
# Usage: pip_test.sh SOURCE_DIR [COMPILER_LAUNCHER [CMAKE_ARGS]]
#   COMPILER_LAUNCHER (e.g. ccache) and CMAKE_ARGS are those of the build under test, so
#   that the compiler cache serves this build too (the sources are compiled all the same).
set -euo pipefail
source_dir="$(cd "$1" && pwd)"
launcher="${2:-}"
cmake_args="${3:-}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
start=$SECONDS

# The source tree without its build directories and version control.
mkdir "$work/src"
tar -C "$source_dir" --exclude=./.git --exclude='./build*' --exclude=./.cache -cf - . | tar -C "$work/src" -xf -
(cd "$work/src" && find . | LC_ALL=C sort) >"$work/before.txt"

/usr/bin/python3 -m venv --system-site-packages "$work/venv"

# The CMake build directory sits in the copy at the depth of a build/ directory, so
# that the compiler cache, with the copy as its base directory, sees the same relative
# paths as in the build under test. setup.py makes a temporary one when it is not given.
export LOCKSTEP_BUILD_DIR="$work/src/pip-cmake-build"
export LOCKSTEP_CMAKE_ARGS="$cmake_args"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
if [ -n "$launcher" ]; then
  export CMAKE_C_COMPILER_LAUNCHER="$launcher" CMAKE_CXX_COMPILER_LAUNCHER="$launcher"
  export CCACHE_BASEDIR="$work/src" CCACHE_NOHASHDIR=1
fi
unset PYTHONPATH
cd "$work"
if ! "$work/venv/bin/python" -m pip install --no-build-isolation --no-index -v "$work/src" >"$work/pip.log" 2>&1; then
  tail -n 60 "$work/pip.log"
  echo "pip install failed"
  exit 1
fi
echo "pip install: $((SECONDS - start)) s"

# Nothing written into the source tree but the build directory it was given.
(cd "$work/src" && find . | grep -v '^\./pip-cmake-build' | LC_ALL=C sort) >"$work/after.txt"
if ! diff -u "$work/before.txt" "$work/after.txt"; then
  echo "pip install wrote into the source tree (above)"
  exit 1
fi

site="$("$work/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')"
for f in __init__.py __init__.pyi py.typed liblockstep.so.1; do
  [ -f "$site/lockstep/$f" ] || { echo "the installed package has no $f"; ls -l "$site/lockstep"; exit 1; }
done
module="$(ls "$site"/lockstep/_lockstep.*.so)"
# The module finds the library beside it, and nothing of the build directory.
runpath="$(readelf -d "$module" | sed -n 's/.*R\(UN\)\?PATH.*\[\(.*\)\]/\2/p')"
# shellcheck disable=SC2016  # the literal $ORIGIN
[ "$runpath" = '$ORIGIN' ] || { echo "the module's run path is '$runpath', not \$ORIGIN"; exit 1; }

# Where libtorch-dev is installed, the package carries the torch backend too.
if [ -f /usr/lib/x86_64-linux-gnu/cmake/Torch/TorchConfig.cmake ] && /usr/bin/python3 -c 'import torch' 2>/dev/null; then
  torch_module="$(ls "$site"/lockstep/_torch.*.so 2>/dev/null || true)"
  [ -n "$torch_module" ] || { echo "libtorch-dev is installed but the package has no lockstep/_torch"; ls -l "$site/lockstep"; exit 1; }
  (cd "$work" && "$work/venv/bin/python" -c 'import lockstep.torch, torch.distributed as d; assert "LOCKSTEP" in d.Backend._plugins') ||
    { echo "lockstep.torch does not import from the installed package"; exit 1; }
fi

cp "$source_dir/tests/package/allreduce.py" "$work/allreduce.py"
"$work/venv/bin/python" "$work/allreduce.py" --expect-under "$work/venv"
echo "pip test passed in $((SECONDS - start)) s"
