#!/usr/bin/env bash
# The two commands of the README:
#   bash run.sh        the tiny end-to-end job on CPU (make data + model, SFT, eval, GRPO-RoC, eval, plot)
#   bash run.sh test   the test suite
# Each creates .venv from the pinned requirements.txt on first use (and again when it changes).
set -euo pipefail
cd "$(dirname "$0")"
if [ ! -f .venv/.installed ] || ! cmp -s requirements.txt .venv/.installed; then
  python3 -m venv .venv
  .venv/bin/pip install --quiet --upgrade pip
  .venv/bin/pip install --quiet -r requirements.txt
  cp requirements.txt .venv/.installed
fi
# the sandbox isolates tool code with bubblewrap and filters its syscalls with libseccomp (through pyseccomp, pinned
# in requirements.txt); install them where we may (root with apt): without them the sandbox refuses to start (or
# runs unisolated only with isolation="none", for trusted code)
if { ! command -v bwrap >/dev/null || ! ldconfig -p 2>/dev/null | grep -q libseccomp.so.2; } \
    && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (apt-get update -qq && apt-get install -y -qq bubblewrap libseccomp2) >/dev/null 2>&1 \
    || echo "note: could not install bubblewrap and libseccomp2"
fi
# tests/test_view.py drives headless chromium (Debian's package): installed the same way, for the tests only
if [ "${1:-}" = test ] && ! command -v chromium >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null 2>&1 || echo "note: could not install chromium"
fi
if [ "${1:-}" = test ]; then
  shift
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # tests run side by side with sandbox workers
  # two pytest workers, each taking whole test files (a file's fixtures are made once), the longest files first
  # (tests/conftest.py orders them): on 2 cores ~1,040 s of tests end in ~9.5 min; `bash run.sh test -n 0` runs
  # it in one process (e.g. to see -s output)
  exec .venv/bin/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder "$@"
fi
exec .venv/bin/python demo.py "$@"
