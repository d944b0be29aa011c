"""``python -m bsrattn.exercises``: list, show, start and check the exercises (:mod:`bsrattn.exercises.cli`)."""

import os
import sys

from bsrattn.exercises.cli import main

try:
    code = main()
except BrokenPipeError:
    # A reader that stopped early (`| head`): as Python's docs advise, send what is left to /dev/null so that the
    # interpreter's final flush raises no second error.
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    code = 1
raise SystemExit(code)
