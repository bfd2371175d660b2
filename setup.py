# SPDX-License-Identifier: Apache-2.0
"""Builds the package fsdp_tools with the project's CMake tree: libckpt and the tools' option
parsing without LibTorch (-DFSDP_WITH_TORCH=OFF), then `cmake --install --component python` into
the directory setuptools packs, so that the wheel holds exactly what `cmake --install` installs
(the extension, its Python files and libckpt's HDF5 module). The version is the CMake project's."""
import os
import re
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
BUILD_BASE = "build-pip"  # beside the CMake trees the README's builds use (build/, build-test/)
(ROOT / BUILD_BASE).mkdir(exist_ok=True)


def cmake_version():
    m = re.search(r"project\(fsdp VERSION ([0-9.]+)", (ROOT / "CMakeLists.txt").read_text())
    if not m:
        sys.exit("setup.py: CMakeLists.txt names no project VERSION")
    return m.group(1)


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        package_parent = Path(self.get_ext_fullpath(ext.name)).resolve().parent.parent
        tree = Path(self.build_temp).resolve() / "cmake"
        configure = ["cmake", "-S", str(ROOT), "-B", str(tree), "-DCMAKE_BUILD_TYPE=Release",
                     "-DFSDP_WITH_TORCH=OFF", "-DFSDP_BUILD_TESTS=OFF", "-DFSDP_BUILD_BENCH=OFF",
                     "-DFSDP_WITH_PYTHON=ON", f"-DPython_EXECUTABLE={sys.executable}",
                     "-DFSDP_PYTHON_INSTALL_DIR=."]
        if not (tree / "CMakeCache.txt").exists():
            configure += ["-G", "Ninja"]
        subprocess.run(configure, check=True)
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 1))
        subprocess.run(["cmake", "--build", str(tree), "--target", "fsdp_tools_native", "-j", jobs], check=True)
        subprocess.run(["cmake", "--install", str(tree), "--component", "python", "--prefix", str(package_parent)],
                       check=True)


setup(
    version=cmake_version(),
    packages=["fsdp_tools"],
    package_dir={"fsdp_tools": "python/fsdp_tools"},
    package_data={"fsdp_tools": ["__init__.pyi", "py.typed"]},
    ext_modules=[Extension("fsdp_tools._native", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
    zip_safe=False,
    options={"build": {"build_base": BUILD_BASE}, "egg_info": {"egg_base": BUILD_BASE}},
)
