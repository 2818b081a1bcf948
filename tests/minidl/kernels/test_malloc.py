"""The glibc malloc tuning (minidl/kernels/cpu/malloc.py): off by default, on with
MINIDL_MALLOC_TUNING=1 or malloc.tune(), left to glibc when its own MALLOC_* variables are set."""
import os
import subprocess
import sys

import pytest

from minidl.kernels.cpu import malloc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_requested_only_by_an_explicit_1():
    assert malloc.requested({}) is False
    assert malloc.requested({"MINIDL_MALLOC_TUNING": "0"}) is False
    assert malloc.requested({"MINIDL_MALLOC_TUNING": "1"}) is True


@pytest.mark.parametrize("value", ["off", "true", "", "2"])
def test_a_bad_setting_names_the_variable_and_the_allowed_values(value):
    with pytest.raises(ValueError, match=r"MINIDL_MALLOC_TUNING must be 0 or unset \(glibc's defaults, the default\) "
                                         rf"or 1 \(keep freed memory in the process\), got '{value}'"):
        malloc.requested({"MINIDL_MALLOC_TUNING": value})


def _fresh_process(code, **env_vars):
    env = dict(os.environ, PYTHONPATH=ROOT)
    for name in (malloc.ENV, *malloc.GLIBC_VARIABLES, "MINIDL_DEVICE"):
        env.pop(name, None)
    env.update(env_vars)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc allocator tuning is Linux-only")
@pytest.mark.parametrize("env_vars, expected", [({}, "False"), ({"MINIDL_MALLOC_TUNING": "0"}, "False"),
                                                ({"MINIDL_MALLOC_TUNING": "1"}, "True"),
                                                ({"MINIDL_MALLOC_TUNING": "1", "MALLOC_TRIM_THRESHOLD_": "1000000"},
                                                 "False")])
def test_import_tunes_only_when_asked_and_glibc_settings_win(env_vars, expected):
    out = _fresh_process("import minidl; from minidl.kernels.cpu import malloc; print(malloc.applied)", **env_vars)
    assert out.stdout.strip() == expected, out.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc allocator tuning is Linux-only")
@pytest.mark.parametrize("env_vars, expected", [({}, "False True"),
                                                ({"MALLOC_MMAP_THRESHOLD_": "65536"}, "False False")])
def test_tune_switches_it_on_in_a_running_process_unless_glibc_settings_are_set(env_vars, expected):
    code = ("import minidl; from minidl.kernels.cpu import malloc; before = malloc.applied; "
            "print(before, malloc.tune())")
    out = _fresh_process(code, **env_vars)
    assert out.stdout.strip() == expected, out.stderr


def test_a_bad_setting_stops_the_import_naming_it():
    out = _fresh_process("import minidl", MINIDL_MALLOC_TUNING="yes")
    assert out.returncode != 0
    assert "MINIDL_MALLOC_TUNING must be 0 or unset" in out.stderr and "got 'yes'" in out.stderr, out.stderr
