import pathlib
import sys

# scheduler_factories.py sits beside the tests (vLLM keeps its create_* helpers the same way).
sys.path.insert(0, str(pathlib.Path(__file__).parent))
