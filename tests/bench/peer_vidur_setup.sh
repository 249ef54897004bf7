#!/usr/bin/env bash
# Build the peer simulator's own environment once: Vidur 0.0.26 from the package index in .venv-vidur (never the
# project's .venv, never `make test`), then its profiling data made local under build/peer_vidur/ (what Vidur would
# fetch from a model hub at run time: tests/bench/peer_vidur.py --setup says what is copied and what synthesized)
# and its execution-time predictors trained once into the same folder. Then: .venv/bin/python tests/bench/peer_vidur.py
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv-vidur/bin/python ]; then
  "$PYTHON" -m venv .venv-vidur
fi
.venv-vidur/bin/python -m pip install -q "vidur==0.0.26"
.venv/bin/python tests/bench/peer_vidur.py --setup
