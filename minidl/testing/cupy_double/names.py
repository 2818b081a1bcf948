"""The pinned CuPy namespace: which names the double may expose, and the strict module type.

``cupy_names_14.txt`` is dir() of CuPy 14.2.0's namespaces (generate_names.py wrote it from
the release wheel). A name that is not listed raises AttributeError naming the release, so
code that runs on the double cannot reach for a function a user's CuPy does not have.
"""
import os
import types

NAMES_FILE = os.path.join(os.path.dirname(__file__), "cupy_names_14.txt")


def _load(path=NAMES_FILE):
    version, sections, current = None, {}, None
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            if line.startswith("#"):
                if version is None and line.startswith("# CuPy "):
                    version = line.split()[2].rstrip(":")
                continue
            if line.startswith("[") and line.endswith("]"):
                current = sections.setdefault(line[1:-1], set())
                continue
            current.add(line)
    if version is None:
        raise RuntimeError(f"{path}: the header '# CuPy <version>: ...' is missing")
    return version, {k: frozenset(v) for k, v in sections.items()}


CUPY_VERSION, SECTIONS = _load()


def allowed(section):
    """The names of one namespace (``"cupy"``, ``"cupy.ndarray"``, ``"cupy.cuda.runtime"``...)."""
    return SECTIONS[section]


def absent(section, name):
    """The AttributeError for a name the pinned release does not have."""
    return AttributeError(f"{section}.{name} is absent from CuPy {CUPY_VERSION}'s namespace "
                          f"(minidl/testing/cupy_double/cupy_names_14.txt): code that uses it "
                          f"breaks on a real GPU")


def not_modelled(section, name):
    """The AttributeError for a name CuPy has but the double does not imitate (yet)."""
    return AttributeError(f"{section}.{name} exists in CuPy {CUPY_VERSION} but the device double "
                          f"does not model it; add it to minidl/testing/cupy_double")


class StrictNamespace(types.ModuleType):
    """A module whose attributes come from ``resolve(name)``, allowed only if the pinned
    release lists them; resolved attributes are cached in the module's __dict__."""

    def __init__(self, module_name, section, resolve):
        super().__init__(module_name)
        self._section = section
        self._resolve = resolve

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__") and name != "__version__":
            raise AttributeError(name)  # importlib and pickle probe dunders; none are CuPy's API
        if name not in allowed(self._section):
            raise absent(self._section, name)
        value = self._resolve(name)
        setattr(self, name, value)
        return value

    def __dir__(self):
        return sorted(allowed(self._section))
