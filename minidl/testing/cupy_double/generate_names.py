"""Regenerates cupy_names_14.txt from an importable CuPy (no GPU needed: only dir() is read).

    PYTHONPATH=<unpacked cupy wheel>:<cuda-pathfinder> python -m minidl.testing.cupy_double.generate_names > names.txt

The double exposes only the names listed, so code that runs on it cannot call a function
that the pinned CuPy release lacks. Each section is one namespace: ``[cupy.random]``.
"""
import sys

# The namespaces minidl and minidl_parallel reach into, and the classes whose attributes
# they use; anything else stays out of the double on purpose.
SECTIONS = {
    "cupy": lambda cupy: cupy,
    "cupy.ndarray": lambda cupy: cupy.ndarray,
    "cupy.ndarray.flags": lambda cupy: cupy._core.flags.Flags,
    "cupy.cuda": lambda cupy: cupy.cuda,
    "cupy.cuda.runtime": lambda cupy: cupy.cuda.runtime,
    "cupy.cuda.Device": lambda cupy: cupy.cuda.Device,
    "cupy.cuda.Stream": lambda cupy: cupy.cuda.Stream,
    "cupy.cuda.Event": lambda cupy: cupy.cuda.Event,
    "cupy.cuda.MemoryPointer": lambda cupy: cupy.cuda.MemoryPointer,
    "cupy.random": lambda cupy: cupy.random,
    "cupy.random.RandomState": lambda cupy: cupy.random.RandomState,
    "cupy.random.Generator": lambda cupy: cupy.random.Generator,
    "cupy.lib.stride_tricks": lambda cupy: cupy.lib.stride_tricks,
    "cupyx": lambda cupy: __import__("cupyx"),
}

# Attributes set in __init__ (cupy/cuda/stream.pyx: ``self.ptr = ...``) that dir() of the
# class cannot see; read from the CuPy 14.2.0 source.
INSTANCE_ATTRIBUTES = {
    "cupy.cuda.Stream": ["device_id", "ptr"],
    "cupy.cuda.Event": ["ptr"],
}


def main(out=sys.stdout):
    import cupy
    out.write(f"# CuPy {cupy.__version__}: dir() of each namespace (generate_names.py)\n")
    for section, get in SECTIONS.items():
        out.write(f"[{section}]\n")
        names = {n for n in dir(get(cupy)) if not n.startswith("_") or n in ("__version__",)}
        names.update(INSTANCE_ATTRIBUTES.get(section, ()))
        names = sorted(names)
        out.write("".join(n + "\n" for n in names))


if __name__ == "__main__":
    main()
