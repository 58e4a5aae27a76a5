# Sourced by test.sh, bench.sh and the scripts that fetch PyTorch: installs the Debian 12 packages
# they need, when missing.

# The current PyTorch on PyPI when pinned: its libtorch for the adapter's tests, its DDP for the
# benchmarks' race.
PYPI_TORCH=2.15.0

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
