import collections
import os
import sys

# tests import the flat modules at the repo root, and run on few cores: one torch thread each
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("OMP_NUM_THREADS", "1")

# `bash run.sh test` runs the suite on two pytest workers that take whole files, the next file in collection order
# whenever one is nearly done (-n 2 --dist loadfile --no-loadscope-reorder). The files that take longest go first,
# so that no worker is handed one of them at the end while the other has nothing left; then the rest by their
# number of tests, the most first (xdist's own order). In place on the 2-core AMD EPYC at f65b57a these three took
# 252, 167 and 141 s of the suite's 1,039 s of tests; replayed from those durations, this order ends the two
# workers at ~520 s each, xdist's own at 572 and 467 s.
LONGEST_FIRST = ["test_train.py", "test_rehearsal.py", "test_environment.py"]


def pytest_collection_modifyitems(items):
    counts = collections.Counter(item.path.name for item in items)

    def place(item):
        name = item.path.name
        first = LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)
        return first, -counts[name]

    # a stable sort: each file's tests stay together, in their own order
    items.sort(key=place)
