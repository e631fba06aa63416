"""What every process a test run starts inherits (tests/__init__.py; the reason and figures: docs/development.md)."""

import subprocess
import sys

from tests.helpers import env_for_tests


def test_the_processes_the_tests_start_wait_for_work_asleep():
    child = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('OMP_WAIT_POLICY'))"],
                           env=env_for_tests(), capture_output=True, text=True, check=True)
    assert child.stdout.strip() == "PASSIVE"
