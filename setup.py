"""The one compiled part: the C run loop of the CPU engines (runtime/_runloop.c, used by runtime/capi.py).
Optional: without a C compiler the install succeeds and the same runs are made from Python. Everything
else is in pyproject.toml (its extension table is still experimental in setuptools, hence this file)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("pipeshard.runtime._runloop", ["runtime/_runloop.c"], optional=True)])
