"""Builds the native MGRIT engine (C + Cython).  Metadata lives in pyproject.toml."""
from Cython.Build import cythonize
from setuptools import Extension, setup

_C_FILES = ["core", "grid", "comm", "relax", "residual", "restrict", "interp", "drive"]

engine = Extension(
    "layerpar._native._core",
    sources=["layerpar/_native/_core.pyx"] + [f"layerpar/_native/{n}.c" for n in _C_FILES],
    include_dirs=["layerpar/_native"],
    extra_compile_args=["-O2", "-std=c99"],
)

setup(ext_modules=cythonize([engine], compiler_directives={"language_level": "3"}))
