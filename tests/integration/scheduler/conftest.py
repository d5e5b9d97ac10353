import pathlib
import sys

# scheduler_h2.py (helpers) sits beside the tests.
sys.path.insert(0, str(pathlib.Path(__file__).parent))
