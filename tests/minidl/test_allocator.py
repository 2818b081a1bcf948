"""The glibc malloc tuning (minidl/_allocator.py): on by default, off with MINIDL_MALLOC_TUNING=0,
left to glibc when its own MALLOC_* variables are set."""
import os
import subprocess
import sys

import pytest

from minidl import _allocator

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_wanted_by_default_and_not_when_turned_off_or_left_to_glibc():
    assert _allocator.wanted({}) is True
    assert _allocator.wanted({"MINIDL_MALLOC_TUNING": "1"}) is True
    assert _allocator.wanted({"MINIDL_MALLOC_TUNING": "0"}) is False
    assert _allocator.wanted({"MALLOC_TRIM_THRESHOLD_": "1000000"}) is False
    assert _allocator.wanted({"MINIDL_MALLOC_TUNING": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}) is False


def test_a_bad_setting_names_the_variable_and_the_values():
    with pytest.raises(ValueError, match=r"MINIDL_MALLOC_TUNING must be 0 \(glibc's defaults\) or 1 .*got 'off'"):
        _allocator.wanted({"MINIDL_MALLOC_TUNING": "off"})


def _applied_in_fresh_process(**env_vars):
    env = dict(os.environ, PYTHONPATH=ROOT)
    for name in ("MINIDL_MALLOC_TUNING", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        env.pop(name, None)
    env.update(env_vars)
    code = "import minidl, minidl._allocator as a; print(a.applied)"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc allocator tuning is Linux-only")
@pytest.mark.parametrize("env_vars, expected", [({}, "True"), ({"MINIDL_MALLOC_TUNING": "1"}, "True"),
                                                ({"MINIDL_MALLOC_TUNING": "0"}, "False"),
                                                ({"MALLOC_TRIM_THRESHOLD_": "1000000"}, "False")])
def test_import_applies_the_tuning_unless_turned_off(env_vars, expected):
    out = _applied_in_fresh_process(**env_vars)
    assert out.stdout.strip() == expected, out.stderr
