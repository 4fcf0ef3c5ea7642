"""The one compiled part: the CPU engines' C code (runtime/capi.py uses it): the run loop (runtime/_runloop.c), the
decode attention op (runtime/_attention.c) and the weight product op (runtime/_matmul.c, its instruction sets chosen
at run time). Optional: without a C compiler the install succeeds, the same runs
are made from Python and decode steps use ONNX Runtime's attention. Everything else is in pyproject.toml (its
extension table is still experimental in setuptools, hence this file)."""

import sys

from setuptools import Extension, setup

# MSVC builds the run loop only (the ops are GCC / Clang C). -O2, not -O3: the kernels unroll where their pragmas say,
# and -O3's further unrolling of the weight product op's three instruction sets cost minutes of compile time for no
# speed (docs/benchmarks.md).
FLAGS = [] if sys.platform == "win32" else ["-O2"]
setup(
    ext_modules=[
        Extension(
            "pipeshard.runtime._runloop",
            ["runtime/_runloop.c", "runtime/_attention.c", "runtime/_matmul.c"],
            depends=["runtime/_ortapi.h", "runtime/_matmul_kernels.h"],
            extra_compile_args=FLAGS,
            optional=True,
        )
    ]
)
