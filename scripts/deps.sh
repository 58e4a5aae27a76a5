# Sourced by test.sh, bench.sh and the scripts that fetch PyTorch: installs the Debian 12 packages
# they need, when missing.

# The current PyTorch on PyPI when pinned: its libtorch for the adapter's tests, its DDP for the
# benchmarks' race.
PYPI_TORCH=2.15.0
# PyPI's safetensors, beside Debian's python3-torch, for the checkpoint round trip with Python.
PYPI_SAFETENSORS=0.8.0
# PyPI's tensorboard (its own reader checks the event files) and matplotlib (the metrics plots).
PYPI_TENSORBOARD=2.21.0
PYPI_MATPLOTLIB=3.10.8

# ensure_packages PKG...: apt-get installs the packages that dpkg does not know as installed.
ensure_packages() {
    local missing=() pkg
    for pkg in "$@"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
    done
    ((${#missing[@]} == 0)) && return 0
    echo "== installing ${missing[*]}"
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
}

# step NAME: prints a header with the time, so long runs show where they are.
step() {
    echo
    echo "== $(date +%H:%M:%S) $*"
}

# torch_venv: makes build/venv-torch with PyPI's torch $PYPI_TORCH (and the CUDA libraries its
# wheel loads, though the benchmarks run on the CPU), once; prints the venv's python.
torch_venv() {
    local venv="$PWD/build/venv-torch"
    if [ ! -f "$venv/complete-$PYPI_TORCH" ]; then
        echo "installing torch $PYPI_TORCH from PyPI into $venv (about 5 GB)" >&2
        rm -rf "$venv"
        python3 -m venv "$venv"
        "$venv/bin/python" -m pip install --quiet "torch==$PYPI_TORCH" numpy >&2
        touch "$venv/complete-$PYPI_TORCH"
    fi
    echo "$venv/bin/python"
}

# safetensors_venv: makes build/venv-safetensors, Debian's Python with its python3-torch and PyPI's
# safetensors $PYPI_SAFETENSORS, once; prints the venv's python.
safetensors_venv() {
    local venv="$PWD/build/venv-safetensors"
    if [ ! -f "$venv/complete-$PYPI_SAFETENSORS" ]; then
        echo "installing safetensors $PYPI_SAFETENSORS from PyPI into $venv" >&2
        rm -rf "$venv"
        /usr/bin/python3 -m venv --system-site-packages "$venv" >&2
        "$venv/bin/python" -m pip install --quiet "safetensors==$PYPI_SAFETENSORS" >&2
        touch "$venv/complete-$PYPI_SAFETENSORS"
    fi
    echo "$venv/bin/python"
}

# metrics_venv: makes build/venv-metrics with PyPI's tensorboard and matplotlib, once; prints the
# venv's python.
metrics_venv() {
    local venv="$PWD/build/venv-metrics" done="complete-$PYPI_TENSORBOARD-$PYPI_MATPLOTLIB"
    if [ ! -f "$venv/$done" ]; then
        echo "installing tensorboard $PYPI_TENSORBOARD and matplotlib $PYPI_MATPLOTLIB from PyPI into $venv" >&2
        rm -rf "$venv"
        /usr/bin/python3 -m venv "$venv" >&2
        "$venv/bin/python" -m pip install --quiet "tensorboard==$PYPI_TENSORBOARD" "matplotlib==$PYPI_MATPLOTLIB" >&2
        touch "$venv/$done"
    fi
    echo "$venv/bin/python"
}
