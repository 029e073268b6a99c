"""The suite's hang guard (tests/conftest.py) on a throwaway suite: a test that hangs once is
ended with its stacks, run again on a fresh xdist worker and passes; an ordinary failure is
not run again."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

SUITE = '''
import os, time

def test_hangs_the_first_time():
    marker = os.path.join(os.path.dirname(__file__), "ran")
    if not os.path.exists(marker):
        open(marker, "w").close()
        time.sleep(600)

def test_fails():
    assert 1 == 2
'''


def test_a_hung_test_is_ended_with_its_stacks_and_run_once_more(tmp_path):
    for name in ("conftest.py", "xla_test_flags.py"):  # the conftest and what it imports
        shutil.copy(os.path.join(HERE, name), tmp_path / name)
    (tmp_path / "test_suite.py").write_text(SUITE)
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts = --reruns 1 --rerun-except .*\n")
    env = dict(os.environ, MASKAHEAD_TEST_HANG_S="4")
    p = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "-p", "no:cacheprovider", "-rA"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 1, out  # test_fails fails
    assert "1 failed, 1 passed, 1 rerun" in out, out
    assert "test_suite.py::test_hangs_the_first_time ran past the hang guard's 4 s" in out, out
    assert 'line 8 in test_hangs_the_first_time' in out, out  # where it hung: the sleep
    assert "PASSED test_suite.py::test_hangs_the_first_time" in out, out
