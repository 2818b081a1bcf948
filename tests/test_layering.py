"""The source tree is layered: no import cycle (lazy imports included), no folder loop, and
minidl never imports minidl_parallel. The rules and their exact definitions are in
tools/import_graph.py (docs/architecture.md#layering); the tests on small fake packages below
show that each rule fails where it should and names what to fix."""
import importlib.util
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load_tool():
    # tools/ is not a package: load the file itself, as a script run from the root would.
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "tools" / "import_graph.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


import_graph = _load_tool()


@pytest.fixture(scope="module")
def project():
    return import_graph.build()


def test_the_project_has_no_import_cycle(project):
    found = import_graph.import_cycles(project)
    assert not found, "\n".join(found)


def test_the_project_has_no_folder_loop(project):
    found = import_graph.folder_loops(project)
    assert not found, "\n".join(found)


def test_minidl_never_imports_minidl_parallel(project):
    assert {"minidl", "minidl_parallel"} <= set(import_graph.top_level_packages(ROOT))
    found = import_graph.forbidden_imports(project)
    assert not found, "\n".join(found)


def test_the_graph_covers_the_project(project):
    # (Were the graph empty, from a wrong root, the three tests above would pass for nothing.)
    files = [p for pkg in import_graph.top_level_packages(ROOT) for p in (ROOT / pkg).rglob("*.py")]
    assert len(project.paths) == len(files) > 100
    assert "minidl.tensor" in project.edges["minidl.ops.primitive"]


# ---- the tool itself, on fake packages ----------------------------------------------------------

def write_tree(root, files):
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


CLEAN = {
    "pkg/__init__.py": "from . import low, high  # a face re-exporting its modules\n",
    "pkg/low.py": "thing = 1\n",
    "pkg/high.py": "from .low import thing\nfrom .sub import one\n\n\ndef late():\n"
                   "    import pkg  # its own package's face (which imports it): the one exception\n",
    "pkg/sub/__init__.py": "from .one import thing\n",
    "pkg/sub/one.py": "from ..low import thing  # a sub-package using its parent's module: fine\n",
}


def test_a_clean_tree_breaks_no_rule(tmp_path):
    graph = import_graph.build(write_tree(tmp_path, CLEAN), ["pkg"])
    assert graph.edges["pkg.high"] == {"pkg.low": 1, "pkg.sub.one": 2, "pkg": 6}  # the lazy import is seen
    assert import_graph.problems(graph) == []


def test_a_face_and_its_module_are_no_cycle_only_alone(tmp_path):
    # low imports pkg, whose __init__ imports high, which imports low: importing either runs the other.
    files = {**CLEAN, "pkg/low.py": "thing = 1\n\n\ndef late():\n    import pkg\n"}
    (message,) = import_graph.import_cycles(import_graph.build(write_tree(tmp_path, files), ["pkg"]))
    assert message == ("import cycle of 4 modules: pkg, pkg.high, pkg.low, pkg.sub.one; e.g. pkg.sub.one -> "
                       "pkg.low (pkg/sub/one.py:1), pkg.low -> pkg (pkg/low.py:5), pkg -> pkg.high (pkg/__init__.py:1), "
                       "pkg.high -> pkg.sub.one (pkg/high.py:2)")


def test_an_import_cycle_is_found_and_named_with_its_lines(tmp_path):
    graph = import_graph.build(write_tree(tmp_path, {**CLEAN,
                                                     "pkg/a.py": "import pkg.b\n",
                                                     "pkg/b.py": "\n\nfrom pkg.a import x\n"}), ["pkg"])
    (message,) = import_graph.import_cycles(graph)
    assert message == ("import cycle of 2 modules: pkg.a, pkg.b; e.g. pkg.a -> pkg.b (pkg/a.py:1), "
                       "pkg.b -> pkg.a (pkg/b.py:3)")


def test_a_lazy_import_cycle_is_a_cycle(tmp_path):
    files = {**CLEAN,
             "pkg/a.py": "from . import b\n",
             "pkg/b.py": "def late():\n    from .c import y\n",
             "pkg/c.py": "import importlib\n\ndef later():\n    return importlib.import_module('pkg.a')\n"}
    (message,) = import_graph.import_cycles(import_graph.build(write_tree(tmp_path, files), ["pkg"]))
    assert message.startswith("import cycle of 3 modules: pkg.a, pkg.b, pkg.c; e.g. pkg.a -> pkg.b (pkg/a.py:1), "
                              "pkg.b -> pkg.c (pkg/b.py:2), pkg.c -> pkg.a (pkg/c.py:4)"), message


def test_a_cycle_through_a_package_face_is_a_cycle(tmp_path):
    # Importing pkg.sub runs its __init__, which imports pkg.sub.b, which imports pkg.a back.
    files = {**CLEAN, "pkg/a.py": "import pkg.sub\n", "pkg/sub/__init__.py": "from . import b\n",
             "pkg/sub/b.py": "from ..a import x\n"}
    (message,) = import_graph.import_cycles(import_graph.build(write_tree(tmp_path, files), ["pkg"]))
    assert message == ("import cycle of 3 modules: pkg.a, pkg.sub, pkg.sub.b; e.g. pkg.a -> pkg.sub (pkg/a.py:1), "
                       "pkg.sub -> pkg.sub.b (pkg/sub/__init__.py:1), pkg.sub.b -> pkg.a (pkg/sub/b.py:1)")


def test_a_folder_loop_without_a_module_cycle_is_found(tmp_path):
    # low -> sub.one and sub.two -> low: no module imports itself back, but pkg/low.py and
    # pkg/sub/ depend on each other (the shape of minidl/_intra_op.py and minidl/kernels/).
    files = {"pkg/__init__.py": "", "pkg/low.py": "from .sub.one import thing\n", "pkg/sub/__init__.py": "",
             "pkg/sub/one.py": "thing = 1\n", "pkg/sub/two.py": "def f():\n    from .. import low\n"}
    graph = import_graph.build(write_tree(tmp_path, files), ["pkg"])
    assert import_graph.import_cycles(graph) == []
    (message,) = import_graph.folder_loops(graph)
    assert message == ("folder loop in pkg/ (2 children: pkg/low.py, pkg/sub/): "
                       "pkg/low.py -> pkg/sub/ by pkg.low -> pkg.sub.one (pkg/low.py:1); "
                       "pkg/sub/ -> pkg/low.py by pkg.sub.two -> pkg.low (pkg/sub/two.py:2)")


def test_a_loop_between_sub_packages_and_between_top_level_packages_is_found(tmp_path):
    files = {"pkg/__init__.py": "", "pkg/x/__init__.py": "from ..y import b\n", "pkg/x/a.py": "",
             "pkg/y/__init__.py": "", "pkg/y/b.py": "def f():\n    from ..x import a\n",
             "other/__init__.py": "", "other/m.py": "import pkg.x.a\n", "pkg/z.py": "import other.m\n"}
    found = import_graph.folder_loops(import_graph.build(write_tree(tmp_path, files), ["other", "pkg"]))
    assert found == ["folder loop between the top-level packages (2 children: other/, pkg/): "
                     "other/ -> pkg/ by other.m -> pkg.x.a (other/m.py:1); pkg/ -> other/ by pkg.z -> other.m (pkg/z.py:1)",
                     "folder loop in pkg/ (2 children: pkg/x/, pkg/y/): pkg/x/ -> pkg/y/ by pkg.x -> pkg.y.b "
                     "(pkg/x/__init__.py:1); pkg/y/ -> pkg/x/ by pkg.y.b -> pkg.x.a (pkg/y/b.py:2)"]


def test_minidl_importing_minidl_parallel_is_refused_even_lazily(tmp_path):
    files = {"minidl/__init__.py": "", "minidl/core.py": "def f():\n    from minidl_parallel import world\n",
             "minidl_parallel/__init__.py": "import minidl\n", "minidl_parallel/world.py": ""}
    graph = import_graph.build(write_tree(tmp_path, files), ["minidl", "minidl_parallel"])
    assert import_graph.forbidden_imports(graph) == [
        "minidl.core imports minidl_parallel.world (minidl/core.py:2): minidl must never import minidl_parallel"]
