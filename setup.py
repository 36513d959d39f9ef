"""Builds the native MGRIT engine (C + Cython).  Metadata lives in pyproject.toml.

With XBRAID_DIR=/path/to/xbraid (an XBraid source tree: its `braid/` folder and
`makefile.inc`), also builds the optional XBraid engine `layerpar._native._xbraid`:
`libbraid.a` is compiled there first if it is missing, with the MPI compiler that
mpi4py uses (MPICC, else the `mpicc` beside this Python, as the `mpich` wheel installs
it), and the wrapper is linked against it.  Without XBRAID_DIR nothing of XBraid is
built.  XBraid's code is never part of this package.
"""
import os
import shlex
import shutil
import subprocess
import sys

from Cython.Build import cythonize
from setuptools import Extension, setup

_C_FILES = ["core", "grid", "comm", "relax", "residual", "restrict", "interp", "drive"]

engine = Extension(
    "layerpar._native._core",
    sources=["layerpar/_native/_core.pyx"] + [f"layerpar/_native/{n}.c" for n in _C_FILES],
    include_dirs=["layerpar/_native"],
    extra_compile_args=["-O2", "-std=c99"],
)


def _mpicc() -> str:
    """The MPI C compiler mpi4py's MPI comes with."""
    if os.environ.get("MPICC"):
        return os.environ["MPICC"]
    beside = os.path.join(os.path.dirname(sys.executable), "mpicc")
    if os.path.exists(beside):
        return beside
    found = shutil.which("mpicc")
    if found is None:
        sys.exit("XBRAID_DIR is set but no MPI C compiler was found: set MPICC, or install "
                 "the `mpich` extra (pip install 'layerpar[mpich]')")
    return found


def _mpi_flags(mpicc: str) -> dict:
    """Include dirs, library dirs, libraries and link args of `mpicc` (MPICH: -show,
    Open MPI: --showme)."""
    for opt in ("-show", "--showme"):
        try:
            out = subprocess.run([mpicc, opt], capture_output=True, text=True, check=True).stdout
            break
        except (OSError, subprocess.CalledProcessError):
            continue
    else:
        sys.exit(f"cannot ask `{mpicc}` for its flags (-show / --showme)")
    flags: dict = {"include_dirs": [], "library_dirs": [], "libraries": [], "link": []}
    for tok in shlex.split(out)[1:]:
        if tok.startswith("-I"):
            flags["include_dirs"].append(tok[2:])
        elif tok.startswith("-L"):
            flags["library_dirs"].append(tok[2:])
        elif tok.startswith("-l"):
            flags["libraries"].append(tok[2:])
        elif tok.startswith("-Wl") or tok.startswith("-pthread"):
            flags["link"].append(tok)
    return flags


def _xbraid_extension(root: str) -> Extension:
    import mpi4py

    root = os.path.abspath(root)
    braid = os.path.join(root, "braid") if os.path.isdir(os.path.join(root, "braid")) else root
    if not os.path.exists(os.path.join(braid, "braid.h")):
        sys.exit(f"XBRAID_DIR={root}: no braid.h in {braid} (XBRAID_DIR must be an XBraid "
                 "source tree, the folder that holds braid/ and makefile.inc)")
    mpicc = _mpicc()
    lib = os.path.join(braid, "libbraid.a")
    if not os.path.exists(lib):
        env = dict(os.environ)
        env["PATH"] = os.path.dirname(mpicc) + os.pathsep + env.get("PATH", "")
        print(f"building {lib} with {mpicc}", file=sys.stderr)
        subprocess.run(["make", "-C", braid, "debug=no", f"MPICC={mpicc}", "libbraid.a"],
                       check=True, env=env, stdout=sys.stderr)
    flags = _mpi_flags(mpicc)
    return Extension(
        "layerpar._native._xbraid",
        sources=["layerpar/_native/_xbraid.pyx"],
        include_dirs=[braid, mpi4py.get_include(), *flags["include_dirs"]],
        library_dirs=flags["library_dirs"],
        libraries=flags["libraries"],
        extra_objects=[lib],
        extra_compile_args=["-O2"],
        extra_link_args=[*flags["link"], "-lm"],
    )


extensions = [engine]
if os.environ.get("XBRAID_DIR"):
    extensions.append(_xbraid_extension(os.environ["XBRAID_DIR"]))

setup(ext_modules=cythonize(extensions, compiler_directives={"language_level": "3"}))
