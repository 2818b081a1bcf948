"""Nothing crosses from minidl into minidl_parallel through a private name.

minidl_parallel uses minidl's public API only (``from minidl.ops.norm import _channel_sum``
would tie it to a body minidl may change at will); a name minidl_parallel needs is made
public in minidl, or the need goes (SyncBatchNormOp overrides ``BatchNorm.sum_over_batch``).
"""
import ast
from pathlib import Path

import pytest

import minidl_parallel

PACKAGE = Path(minidl_parallel.__file__).parent


def _private_imports(path):
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                node.module.split(".")[0] == "minidl":
            module_private = any(part.startswith("_") for part in node.module.split("."))
            found += [f"line {node.lineno}: from {node.module} import {alias.name}" for alias in node.names
                      if module_private or alias.name.startswith("_")]
        elif isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {alias.name}" for alias in node.names
                      if alias.name.split(".")[0] == "minidl" and any(p.startswith("_") for p in alias.name.split("."))]
    return found


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_minidl_parallel_imports_no_private_name_of_minidl(path):
    assert _private_imports(path) == []
