"""common.fast_exit: a process can leave without the last garbage collection."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PROGRAM = """
import sys
from common.fast_exit import skip_final_collection

class Cycle:
    def __del__(self):
        print("collected at exit")

cycle = Cycle()
cycle.itself = cycle
del cycle
if sys.argv[1] == "skip":
    skip_final_collection()
"""


def exit_output(mode: str) -> str:
    proc = subprocess.run([sys.executable, "-c", PROGRAM, mode], cwd=REPO, capture_output=True, text=True, check=True)
    return proc.stdout


def test_the_last_collection_is_skipped():
    assert exit_output("collect") == "collected at exit\n"
    assert exit_output("skip") == ""
