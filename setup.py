"""Builds the Python package `lockstep` with the project's CMake, for
`pip install --no-build-isolation --no-index .` (pyproject.toml; docs/packaging.md).

The extension module and the library it loads are built by CMake (only the targets the
module needs), and both are copied into the package: lockstep/_lockstep*.so with an
rpath of $ORIGIN, and lockstep/liblockstep.so.1. Nothing is written into the source
tree: setuptools' build and egg-info directories and the CMake build directory are
temporary (LOCKSTEP_BUILD_DIR names a CMake build directory to use, and keep, instead).

Environment:
  LOCKSTEP_CMAKE_ARGS   more arguments for the CMake configure step (shell syntax)
  LOCKSTEP_BUILD_DIR    the CMake build directory (default: a temporary one)
  CMAKE_BUILD_PARALLEL_LEVEL, CMAKE_C_COMPILER_LAUNCHER, CMAKE_CXX_COMPILER_LAUNCHER:
                        read by CMake itself (e.g. ccache as the launcher)
"""

import atexit
import glob
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile

from setuptools import Extension, setup
from setuptools.command.build import build
from setuptools.command.build_ext import build_ext
from setuptools.command.egg_info import egg_info

SOURCE_DIR = os.path.dirname(os.path.abspath(__file__))
_scratch = None


def scratch_dir():
    """One temporary directory per setup.py process, removed at its exit."""
    global _scratch
    if _scratch is None:
        _scratch = tempfile.mkdtemp(prefix="lockstep-setup-")
        atexit.register(shutil.rmtree, _scratch, True)
    return _scratch


def project_version():
    with open(os.path.join(SOURCE_DIR, "CMakeLists.txt"), encoding="utf-8") as f:
        match = re.search(r"project\(lockstep\s+VERSION\s+([0-9.]+)", f.read())
    if not match:
        raise RuntimeError("no `project(lockstep VERSION x.y.z` in CMakeLists.txt")
    return match.group(1)


class BuildOutsideTree(build):
    """setuptools' build directory (default ./build, which may be a CMake build
    directory of the user's) goes to a temporary directory."""

    def finalize_options(self):
        if self.build_base == "build":
            self.build_base = os.path.join(scratch_dir(), "setuptools-build")
        super().finalize_options()


class EggInfoOutsideTree(egg_info):
    """lockstep.egg-info goes to a temporary directory, not the source tree."""

    def finalize_options(self):
        if self.egg_base is None:
            self.egg_base = os.path.join(scratch_dir(), "egg-info")
            os.makedirs(self.egg_base, exist_ok=True)
        super().finalize_options()


class CMakeBuildExt(build_ext):
    """Builds lockstep._lockstep (and lockstep._torch where libtorch-dev is there) and liblockstep
    with CMake and copies them into the package."""

    def build_extension(self, ext):
        build_dir = os.environ.get("LOCKSTEP_BUILD_DIR") or os.path.join(scratch_dir(), "cmake-build")
        configure = [
            "cmake", "-S", SOURCE_DIR, "-B", build_dir,
            "-DCMAKE_BUILD_TYPE=Release",
            "-DLOCKSTEP_BUILD_PYTHON=ON",
            "-DLOCKSTEP_PYTHON_BUNDLED=ON",
            "-DLOCKSTEP_BUILD_TESTS=OFF",
            "-DLOCKSTEP_BUILD_TOOLS=OFF",
            "-DLOCKSTEP_BUILD_TESTBED=OFF",
            "-DLOCKSTEP_BUILD_BENCH=OFF",
            "-DLOCKSTEP_BUILD_DOCS=OFF",
            "-DPython3_EXECUTABLE=" + sys.executable,
        ] + shlex.split(os.environ.get("LOCKSTEP_CMAKE_ARGS", ""))
        subprocess.run(configure, check=True)
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or str(os.cpu_count() or 1)
        subprocess.run(["cmake", "--build", build_dir, "--target", "_lockstep", "--parallel", jobs], check=True)

        modules = glob.glob(os.path.join(build_dir, "python", "lockstep", "_lockstep*.so"))
        library = os.path.join(build_dir, "lib", "liblockstep.so.1")
        if len(modules) != 1 or not os.path.exists(library):
            raise RuntimeError(f"the CMake build in {build_dir} did not produce the module and liblockstep.so.1")
        destination = os.path.dirname(os.path.abspath(self.get_ext_fullpath(ext.name)))
        os.makedirs(destination, exist_ok=True)
        # The module's file name is CMake's (the interpreter's own suffix); the library is
        # copied under its soname, the name the module asks for.
        shutil.copyfile(modules[0], os.path.join(destination, os.path.basename(modules[0])))
        shutil.copyfile(library, os.path.join(destination, "liblockstep.so.1"))
        # The torch.distributed backend (lockstep.torch), where CMake found libtorch-dev.
        if torch_backend_configured(build_dir):
            subprocess.run(["cmake", "--build", build_dir, "--target", "_torch", "--parallel", jobs], check=True)
            for module in glob.glob(os.path.join(build_dir, "python", "lockstep", "_torch*.so")):
                shutil.copyfile(module, os.path.join(destination, os.path.basename(module)))


def torch_backend_configured(build_dir):
    """Whether the CMake build has the target _torch (libtorch-dev found, not turned off)."""
    with open(os.path.join(build_dir, "CMakeCache.txt"), encoding="utf-8") as cache:
        entries = dict(line.rstrip("\n").split("=", 1) for line in cache if "=" in line and not line.startswith(("#", "//")))
    library = entries.get("LOCKSTEP_TORCH_PYTHON_LIBRARY:FILEPATH", "")
    return entries.get("LOCKSTEP_BUILD_TORCH:BOOL", "ON") == "ON" and bool(library) and not library.endswith("NOTFOUND")


setup(
    version=project_version(),
    # One extension, built by CMake: declared so that the wheel is platform-specific.
    ext_modules=[Extension("lockstep._lockstep", sources=[])],
    cmdclass={"build": BuildOutsideTree, "egg_info": EggInfoOutsideTree, "build_ext": CMakeBuildExt},
    zip_safe=False,
)
