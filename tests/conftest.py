import os
import sys

# tests import the flat modules at the repo root, and run on few cores: one torch thread each
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("OMP_NUM_THREADS", "1")
