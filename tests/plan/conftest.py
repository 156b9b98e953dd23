"""tests/plan: the counting script beside the tests is importable as ``engine_bytes``."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
