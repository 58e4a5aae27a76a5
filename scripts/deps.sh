# Sourced by test.sh and bench.sh: installs the Debian 12 packages they need, when missing.

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
