#!/usr/bin/env bash
# ddprun's GPU checks (benchmarks/gpu_check.py), bounded in time; results in OUT_DIR, else $OUT, else ./gpu_check_out.
#
#   bash benchmarks/gpu_check.sh [OUT_DIR] [--rehearse-on-cpu]
#
# Runs this tree's ddprun in a venv of its own that sees the packages of the python3 it starts
# from (a GPU machine's torch cannot be downloaded there: nothing is reachable). Where that venv
# cannot be made, it runs with python3 as it is. Without a GPU, the GPU steps are skipped.
set -u
cd "$(dirname "$0")/.."
ARG_OUT=""
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then ARG_OUT=$1; shift; fi
OUT_DIR="${ARG_OUT:-${OUT:-gpu_check_out}}"   # an argument wins over $OUT
BUDGET_S="${GPU_CHECK_BUDGET_S:-480}"        # the steps; setup and write-up come on top
VENV="${GPU_CHECK_VENV:-${TMPDIR:-/tmp}/ddprun-gpu-venv}"  # outside the tree: never carried or committed
mkdir -p "$OUT_DIR"
started=$(date +%s)

pick_python() {
    # A venv whose site-packages include python3's own (a .pth file: --system-site-packages would
    # only reach the base interpreter's, not a venv's like /opt/torch/.venv), with ddprun installed
    # editable, offline. Any failure: python3 as it is, with this tree on PYTHONPATH.
    local parent_site venv_site
    parent_site=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || return 1
    if [ ! -x "$VENV/bin/python" ]; then
        # No pip of its own: pip, setuptools and the rest come from python3's site-packages.
        timeout 60 python3 -m venv --without-pip "$VENV" || return 1
    fi
    venv_site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || return 1
    echo "$parent_site" > "$venv_site/_gpu_check_parent.pth"
    timeout 120 "$VENV/bin/python" -m pip install -q --no-index --no-build-isolation -e . 2>/dev/null \
        || timeout 120 "$VENV/bin/python" -m pip install -q --no-index --no-build-isolation --no-deps -e . \
        || return 1
    "$VENV/bin/python" -c 'import ddprun.cli, torch' || return 1
    echo "$VENV/bin/python"
}

PY=$(pick_python 2>"$OUT_DIR/setup.log") || PY=python3
echo "gpu_check: python $PY ($(( $(date +%s) - started )) s of setup; log in $OUT_DIR/setup.log)" >&2
# The script stops itself at its budget; the hard limit is for a step that ignores it.
timeout --kill-after=10 $(( BUDGET_S + 60 )) "$PY" benchmarks/gpu_check.py "$OUT_DIR" --budget "$BUDGET_S" "$@"
code=$?
echo "gpu_check: exit $code after $(( $(date +%s) - started )) s; results in $OUT_DIR/gpu_check.txt and .json" >&2
exit $code
