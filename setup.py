"""Builds mpscope._core, the statistics kernel that needs no PyTorch headers (mpscope/_core.cpp).

Everything else is in pyproject.toml. The extension is optional: where it cannot be compiled (no
C++ compiler), mpscope installs without it and takes its CPU statistics through the PyTorch
extension built at run time, or through torch ops (see mpscope/kernel.py).
"""

import sys

from setuptools import Extension, setup

_UNIX = sys.platform != "win32"
_OPENMP = sys.platform.startswith("linux")  # (Apple clang has no -fopenmp)

setup(
    ext_modules=[
        Extension(
            "mpscope._core",
            sources=["mpscope/_core.cpp"],
            depends=["mpscope/_stats_core.h"],
            language="c++",
            extra_compile_args=(["-O3", "-std=c++17"] if _UNIX else ["/O2", "/std:c++17"])
            + (["-fopenmp"] if _OPENMP else []),
            extra_link_args=["-fopenmp"] if _OPENMP else [],
            optional=True,
        )
    ]
)
