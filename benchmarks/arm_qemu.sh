#!/usr/bin/env bash
# tinyrt on 64-bit Arm, emulated: an arm64 Debian bookworm root run under qemu-user, tinyrt
# installed there from this working tree, its CPU kernels' tests run there and the default
# model's greedy answer compared with this machine's.
#
#   sudo benchmarks/arm_qemu.sh [-k PYTEST_EXPR] [--no-tests] [--no-generate]
#
# -k narrows tests/test_kernels_cpu.py (e.g. -k "gemv or tile or gemm"); --no-tests and
# --no-generate skip the tests or the default model (which the Arm side fetches with pip, as
# tinyrt does). Needs root (debootstrap, chroot, mounts) and a Debian host. The root is built
# once and kept in ROOT, by default ~/.cache/tinyrt/arm64-root (root's home under sudo;
# TINYRT_ARM_ROOT to move it); this script creates it, marks it as its own and deletes nothing
# outside it. Expect runs about 10x slower than native: under emulation the kernels' first
# compile takes minutes. The x86 answer comes from `python -m tinyrt` of this checkout's .venv
# (the README's), else of python3 (X86_PYTHON names another interpreter).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
ROOT=${TINYRT_ARM_ROOT:-${XDG_CACHE_HOME:-$HOME/.cache}/tinyrt/arm64-root}
ROOT=$(realpath -m "$ROOT")
MARK="$ROOT/.tinyrt-arm64-root"           # this script's root: safe to add to and refresh
if [ -z "${X86_PYTHON:-}" ]; then
    X86_PYTHON=python3
    [ -x "$REPO/.venv/bin/python" ] && X86_PYTHON="$REPO/.venv/bin/python"
fi
PROMPT="What is the capital of France?"
TESTS=(-k "")
TEST=1
GENERATE=1
while [ $# -gt 0 ]; do
    case "$1" in
        -k) TESTS=(-k "$2"); shift 2 ;;
        --no-tests) TEST=0; shift ;;
        --no-generate) GENERATE=0; shift ;;
        *) echo "unknown option $1" >&2; exit 2 ;;
    esac
done
[ "$(id -u)" = 0 ] || { echo "needs root (debootstrap, chroot, mounts)" >&2; exit 1; }

say() { printf '[arm_qemu %s] %s\n' "$(date +%T)" "$*" >&2; }

# -- the emulator -------------------------------------------------------------------------------
if ! command -v qemu-aarch64-static >/dev/null || ! command -v debootstrap >/dev/null \
        || ! command -v update-binfmts >/dev/null; then
    say "installing qemu-user-static, debootstrap, binfmt-support"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq qemu-user-static debootstrap \
        binfmt-support >/dev/null
fi
BINFMT=/proc/sys/fs/binfmt_misc
if [ ! -e "$BINFMT/register" ]; then
    mount binfmt_misc -t binfmt_misc "$BINFMT"
fi
if [ ! -e "$BINFMT/qemu-aarch64" ]; then
    update-binfmts --enable qemu-aarch64 || update-binfmts --import qemu-aarch64
fi

# -- the root, once ------------------------------------------------------------------------------
mirror() {   # the host's Debian mirror: the first bookworm source (deb822 or one-line)
    local f
    for f in /etc/apt/sources.list.d/*.sources; do
        [ -e "$f" ] || continue
        awk '/^URIs:/ {u = $2}
             /^Suites:/ && / bookworm( |$)/ && u ~ /debian\/?$/ {print u; exit}' "$f"
    done
    [ -e /etc/apt/sources.list ] && awk '$1 == "deb" && $3 == "bookworm" {print $2}' \
        /etc/apt/sources.list
    echo http://deb.debian.org/debian
}
if [ ! -e "$MARK.ready" ]; then
    if [ -e "$ROOT" ] && [ ! -e "$MARK" ] && [ -n "$(ls -A "$ROOT")" ]; then
        echo "$ROOT exists and is not this script's root: set TINYRT_ARM_ROOT elsewhere" >&2
        exit 1
    fi
    mkdir -p "$ROOT" && touch "$MARK"
    MIRROR=$(mirror | sed -n 1p)
    say "debootstrap arm64 bookworm from $MIRROR into $ROOT (once; slow under emulation)"
    debootstrap --arch=arm64 --variant=minbase \
        --include=python3,python3-venv,python3-pip,ca-certificates bookworm "$ROOT" "$MIRROR"
    touch "$MARK.ready"
fi

# -- mounts for the chroot, undone on exit (only those made here) ---------------------------------
MOUNTED=()
cleanup() {
    local i
    for ((i = ${#MOUNTED[@]} - 1; i >= 0; i--)); do umount "${MOUNTED[i]}" || true; done
}
trap cleanup EXIT
bind() {   # bind  SRC  DST-inside-root
    mkdir -p "$ROOT$2"
    if ! mountpoint -q "$ROOT$2"; then
        mount --bind "$1" "$ROOT$2" && MOUNTED+=("$ROOT$2")
    fi
}
bind /proc /proc
bind /dev /dev
bind /sys /sys
PATH_IN=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
run() { chroot "$ROOT" /usr/bin/env -i HOME=/root PATH="$PATH_IN" LANG=C.UTF-8 "$@"; }

# the host's extra certificate authorities and pip configuration (a proxy's CA, a mirror)
if compgen -G "/usr/local/share/ca-certificates/*" >/dev/null; then
    mkdir -p "$ROOT/usr/local/share/ca-certificates"
    cp -r /usr/local/share/ca-certificates/. "$ROOT/usr/local/share/ca-certificates/"
    run update-ca-certificates >/dev/null
fi
[ -e /etc/pip.conf ] && cp /etc/pip.conf "$ROOT/etc/pip.conf"
if [ -e "$HOME/.config/pip/pip.conf" ]; then
    mkdir -p "$ROOT/root/.config/pip"
    cp "$HOME/.config/pip/pip.conf" "$ROOT/root/.config/pip/pip.conf"
fi

# -- tinyrt from this working tree (tracked and untracked files git does not ignore) --------------
SRC=/opt/tinyrt-src
VENV=/opt/tinyrt-venv
rm -rf "${ROOT:?}$SRC" && mkdir -p "$ROOT$SRC"
git -C "$REPO" ls-files -co --exclude-standard -z | \
    (cd "$REPO" && tar --null --ignore-failed-read -T - -cf - 2>/dev/null) | \
    tar -xf - -C "$ROOT$SRC"
[ -e "$ROOT$VENV/bin/python" ] || run python3 -m venv "$VENV"
# installed again only when the sources changed (a reinstall costs minutes under emulation)
SUM=$(cd "$ROOT$SRC" && find . -type f -print0 | sort -z | xargs -0 sha256sum | sha256sum)
if [ "$(cat "$ROOT$VENV/.tinyrt-sources" 2>/dev/null)" != "$SUM" ]; then
    say "pip install tinyrt (and pytest, hypothesis) into the arm64 venv"
    start=$(date +%s)
    run "$VENV/bin/pip" install -q --disable-pip-version-check "$SRC" pytest hypothesis
    echo "$SUM" > "$ROOT$VENV/.tinyrt-sources"
    say "installed in $(( $(date +%s) - start )) s"
fi
run "$VENV/bin/python" -c "import platform, numba, llvmlite.binding as ll; \
print('arm64 root:', platform.machine(), 'numba', numba.__version__, 'cpu', ll.get_host_cpu_name())"

# -- the kernels' tests --------------------------------------------------------------------------
status=0
if [ "$TEST" = 1 ]; then
    say "tests/test_kernels_cpu.py ${TESTS[*]}"
    start=$(date +%s)
    run /bin/bash -c "cd /tmp && $VENV/bin/python -m pytest -q -p no:cacheprovider \
        $SRC/tests/test_kernels_cpu.py $(printf '%q ' "${TESTS[@]}")" || status=$?
    say "tests: exit $status in $(( $(date +%s) - start )) s"
fi

# -- the default model's greedy answer, against this machine's -----------------------------------
if [ "$GENERATE" = 1 ]; then
    args=(generate --temperature 0 -n 16 "$PROMPT")
    start=$(date +%s)
    arm=$(run /bin/bash -c "cd /tmp && $VENV/bin/tinyrt $(printf '%q ' "${args[@]}")")
    say "arm64 generate in $(( $(date +%s) - start )) s"
    printf 'arm64: %s\n' "$arm"
    if ! x86=$(cd /tmp && "$X86_PYTHON" -m tinyrt "${args[@]}"); then
        say "no x86 answer from $X86_PYTHON (X86_PYTHON: an interpreter with tinyrt)"
        exit 1
    fi
    printf 'x86:   %s\n' "$x86"
    if [ "$arm" = "$x86" ]; then say "greedy text: the same"; else
        say "greedy text: DIFFERS"; status=1; fi
fi
exit $status
