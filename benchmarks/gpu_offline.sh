#!/usr/bin/env bash
# benchmarks/gpu.py on a GPU machine with no network: its own Python already has torch (CUDA),
# numpy, numba and transformers, but not all of tinyrt's pure-Python dependencies, and no
# package index to fetch them from.
#
#   bash benchmarks/gpu_offline.sh prepare         # here, with a network: fills .gpu_offline/
#   bash benchmarks/gpu_offline.sh run [ARGS]      # there: python benchmarks/gpu.py ARGS
#   bash benchmarks/gpu_offline.sh check [ARGS]    # there: python benchmarks/gpu_check.py ARGS
#   bash benchmarks/gpu_offline.sh first DIR       # there: the first minutes' checklist (below)
#
# prepare: a wheel of tinyrt built from the working tree, and a wheelhouse of the py3-none-any
#   wheels of its dependencies (binary ones are left out: the machine has them, built for it),
#   and a hash of tinyrt's sources, into .gpu_offline/ (a few MB; bring it with the tree).
# run: a venv over ${PYTHON:-python3}'s packages (--system-site-packages: the machine's torch,
#   numba and numpy as they are; nothing it has is installed again) in .gpu_offline_venv/,
#   tinyrt installed from .gpu_offline/ with pip --no-index (pip takes only what is missing),
#   then benchmarks/gpu.py ARGS with that venv's python (check: gpu_check.py). Sources changed
#   since prepare are built there again if that Python has setuptools, and refused if not.
set -euo pipefail

ROOT=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd -P)
OFF="$ROOT/.gpu_offline"
VENV="$ROOT/.gpu_offline_venv"
PY=${PYTHON:-python3}
# What tinyrt's wheel is built from (pyproject's package-dir: tinyrt.models is models/, ...)
SOURCES=(pyproject.toml README.md tinyrt models kernels converters)
MARK=.made-by-gpu_offline      # in the folders this script makes (the only ones it removes)

say() { echo "gpu_offline: $*" >&2; }
die() { say "$*"; exit 1; }

TMP=""         # this run's scratch folder, removed at its end
cleanup() { if [[ -n "$TMP" ]]; then rm -rf -- "$TMP"; TMP=""; fi; }
trap cleanup EXIT

usage() {
    echo "usage: bash benchmarks/gpu_offline.sh prepare | run [gpu.py's options]" \
         "| check [gpu_check.py's options] | first DIR [MODEL] [--smoke]" >&2
    exit 2
}

# The SHA-256 of tinyrt's sources (names and contents; caches left out), printed.
sources_hash() {
    "$1" - "$ROOT" "${SOURCES[@]}" <<'EOF'
import hashlib, os, sys
root, h = sys.argv[1], hashlib.sha256()
for top in sys.argv[2:]:
    files = [top] if os.path.isfile(os.path.join(root, top)) else sorted(
        os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/")
        for d, dirs, names in os.walk(os.path.join(root, top))
        if "__pycache__" not in d.split(os.sep) for f in names if not f.endswith(".pyc"))
    for f in files:
        with open(os.path.join(root, f), "rb") as fh:
            h.update(f.encode() + b"\0" + hashlib.sha256(fh.read()).digest())
print(h.hexdigest())
EOF
}

# Copy tinyrt's sources into $1 (a wheel is built there, so the tree gets no build/ folder).
copy_sources() {
    mkdir -p "$1"
    tar -C "$ROOT" --exclude=__pycache__ --exclude='*.pyc' -cf - "${SOURCES[@]}" | tar -C "$1" -xf -
}

# Remove folder $1 if this script made it (it holds $MARK); refuse if anything else is there.
remove_ours() {
    if [[ -e "$1" ]]; then
        [[ -f "$1/$MARK" ]] || die "$1 is not this script's (no $MARK in it): move it away first"
        rm -rf -- "$1"
    fi
}

# The first line of pip's log $1 that says what went wrong.
pip_error() {
    grep -m1 -E '^ERROR|Error' "$1" || tail -n1 "$1"
}

prepare() {
    "$PY" -m pip --version >/dev/null 2>&1 || die "no pip for $PY (set PYTHON to one with pip)"
    TMP=$(mktemp -d)
    local tmp=$TMP out="$TMP/out"
    mkdir -p "$out/tinyrt" "$out/wheels"
    touch "$out/$MARK"
    copy_sources "$tmp/src"
    say "building tinyrt's wheel from the working tree ..."
    "$PY" -m pip wheel -q --no-deps -w "$out/tinyrt" "$tmp/src" >"$tmp/pip.log" 2>&1 ||
        die "tinyrt's wheel did not build: $(pip_error "$tmp/pip.log")"
    local wheel
    wheel=$(ls "$out/tinyrt"/tinyrt-*-py3-none-any.whl 2>/dev/null) ||
        die "tinyrt's wheel is not a py3-none-any wheel: $(ls "$out/tinyrt")"
    # Every package tinyrt needs (as if nothing were installed), from pip's resolver
    say "resolving tinyrt's dependencies ..."
    "$PY" -m pip install -q --dry-run --ignore-installed --report "$tmp/report.json" "$wheel" \
        >"$tmp/pip.log" 2>&1 ||
        die "tinyrt's dependencies did not resolve: $(pip_error "$tmp/pip.log")"
    # name==version of those it chose a pure wheel (*-none-any) of, and of the others; and
    # "3.10 name" where a package's Requires-Python leaves out a Python from 3.10 to 3.13
    "$PY" - "$tmp/report.json" "$tmp" <<'EOF'
import json, os, sys
try:
    from packaging.specifiers import SpecifierSet
except ImportError:
    from pip._vendor.packaging.specifiers import SpecifierSet
report, tmp = sys.argv[1:]
with open(f"{tmp}/pure.txt", "w") as pure, open(f"{tmp}/binary.txt", "w") as binary, \
        open(f"{tmp}/older.txt", "w") as older:
    for p in json.load(open(report))["install"]:
        meta, url = p["metadata"], p["download_info"]["url"]
        if meta["name"].lower() != "tinyrt":
            print(f"{meta['name']}=={meta['version']}",
                  file=pure if url.endswith("-none-any.whl") else binary)
            spec = SpecifierSet(meta.get("requires_python") or "")
            for v in ("3.10", "3.11", "3.12", "3.13"):
                if v not in spec:
                    print(v, meta["name"], file=older)
EOF
    local -a pure_only=(--no-deps --only-binary=:all: --platform any --abi none --implementation py
                        -d "$out/wheels")
    say "downloading $(wc -l <"$tmp/pure.txt") pure-Python wheels ..."
    "$PY" -m pip download -q "${pure_only[@]}" -r "$tmp/pure.txt" >"$tmp/pip.log" 2>&1 ||
        die "the pure-Python wheels did not download: $(pip_error "$tmp/pip.log")"
    # Where pip chose a binary wheel, a pure one of the same version if there is one (wcwidth);
    # the rest the machine must have
    local req v name
    while read -r req; do
        "$PY" -m pip download -q "${pure_only[@]}" "$req" >/dev/null 2>&1 ||
            echo "${req%%==*}" >>"$out/needed-on-the-machine.txt"
    done <"$tmp/binary.txt"
    touch "$out/needed-on-the-machine.txt"
    # For a Python a chosen version is not for, the newest that is
    while read -r v name; do
        grep -qx "$name" "$out/needed-on-the-machine.txt" && continue
        "$PY" -m pip download -q "${pure_only[@]}" --python-version "$v" "$name" >/dev/null 2>&1 ||
            say "note: no pure wheel of $name for Python $v"
    done <"$tmp/older.txt"
    sources_hash "$PY" >"$out/sources.sha256"
    (cd "$out/wheels" && ls) >"$out/wheels.txt"
    remove_ours "$OFF"
    mv "$out" "$OFF"
    say "prepared .gpu_offline/ ($(du -sh "$OFF" | cut -f1)): $(basename "$wheel") and" \
        "$(wc -l <"$OFF/wheels.txt") pure-Python wheels; binary, the machine's own:" \
        "$(paste -sd' ' "$OFF/needed-on-the-machine.txt")"
}

# tinyrt installed in .gpu_offline_venv/ over $PY's packages, from .gpu_offline/ (once per sources).
installed() {
    [[ -f "$OFF/sources.sha256" ]] || die "no .gpu_offline/ in $ROOT: run" \
        "'bash benchmarks/gpu_offline.sh prepare' where there is a network, and bring it along"
    command -v "$PY" >/dev/null || die "no Python $PY (set PYTHON to the machine's)"
    "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null ||
        die "$PY is not Python 3.10 or later (set PYTHON to the machine's)"
    local now base stamp
    now=$(sources_hash "$PY")
    base=$("$PY" -c 'import sys; print(sys.prefix)')
    stamp="$now $base"
    if [[ -f "$VENV/$MARK" && "$(cat "$VENV/$MARK")" == "$stamp" ]] && "$VENV/bin/python" -c ''
    then
        say "tinyrt already installed in .gpu_offline_venv/ (over $base)"
    else
        install "$now" "$stamp"
    fi
    cleanup
    cd "$ROOT"
}

# A GPU machine's first minutes (docs/GPU.md) in one command of under 10 minutes: gpu.py on one
# model (the figures first: a step that overruns then costs the least), gpu_check.py on it
# (greedy tokens against the CPU path, a profile of the step), then the kernel tests; each step
# stopped at its limit and all by $FIRST_BUDGET seconds from the start (570, the install
# included), each run from DIR (so that python finds the installed tinyrt, not the checkout's
# tinyrt/), its output in DIR/STEP.out and .err, a line a step on stderr. The tests: those of the
# CUDA kernels and the device's decode step, or $GPU_TESTS (paths in the checkout). --smoke: the
# same steps without a GPU (toy models on the CPU device and in Numba's CUDA simulator).
first() {
    local dir="" model="" smoke="" a
    for a in "$@"; do
        case "$a" in
            --smoke) smoke=1 ;;
            -*) usage ;;
            *) if [[ -z "$dir" ]]; then dir=$a
               elif [[ -z "$model" ]]; then model=$a
               else usage; fi ;;
        esac
    done
    [[ -n "$dir" ]] || usage
    mkdir -p -- "$dir" 2>/dev/null && dir=$(cd -- "$dir" && pwd -P) || die "no folder $dir"
    local -a tests
    local t ours="tests/test_gemv_gpu.py tests/test_kernels_gpu.py tests/test_device_decode.py"
    for t in ${GPU_TESTS:-$ours}; do tests+=("$ROOT/$t"); done
    local deadline=$((SECONDS + ${FIRST_BUDGET:-570})) failed=0
    installed
    local py="$VENV/bin/python" b="$ROOT/benchmarks"
    local -a gpu=(--json) check=(--json)
    if [[ -n "$smoke" ]]; then gpu+=(--device cpu --smoke); check+=(--smoke); fi
    step 270 gpu "$py" "$b/gpu.py" --models "${model:-llama2-7b}" "${gpu[@]}"
    step 150 check "$py" "$b/gpu_check.py" --model "${model:-llama2-7b}" "${check[@]}"
    step 140 tests "$py" -m pytest -q -p no:cacheprovider --rootdir "$ROOT" "${tests[@]}"
    return "$failed"
}

# step LIMIT NAME CMD...: CMD run from $dir within LIMIT seconds (less where $deadline is nearer),
# its output in $dir/NAME.out and .err; a failure sets $failed (first's)
step() {
    local limit=$1 name=$2 start=$SECONDS rc=0
    shift 2
    (( limit > deadline - SECONDS - 5 )) && limit=$((deadline - SECONDS - 5))
    if (( limit < 1 )); then
        say "$name: skipped: no time left"
        failed=1
        return
    fi
    say "$name: $* (at most $limit s) ..."
    (cd "$dir" && PYTHONUNBUFFERED=1 timeout -k 5 "$limit" "$@" >"$name.out" 2>"$name.err") ||
        rc=$?
    local took=$((SECONDS - start))
    if [[ $rc -eq 0 ]]; then
        say "$name: done in $took s"
        return
    fi
    failed=1
    if [[ ($rc -eq 124 || $rc -eq 137) && $took -ge $limit ]]; then
        say "$name: stopped at its limit of $limit s"
    else
        local why
        why=$(tail -n1 "$dir/$name.err")
        [[ -n "$why" ]] || why=$(tail -n1 "$dir/$name.out")
        say "$name: failed (exit status $rc) in $took s: $why"
    fi
}

# A fresh venv over $PY's packages, tinyrt and what it misses installed into it from .gpu_offline/.
install() {
    local now=$1 stamp=$2 rebuild=""
    if [[ "$now" != "$(cat "$OFF/sources.sha256")" ]]; then
        "$PY" -c 'import setuptools' 2>/dev/null || die "tinyrt's sources changed since prepare," \
            "and $PY has no setuptools to build them: run" \
            "'bash benchmarks/gpu_offline.sh prepare' again where there is a network"
        rebuild=1
    fi
    TMP=$(mktemp -d)
    local tmp=$TMP
    remove_ours "$VENV"
    # The venv sees the packages $PY sees: --system-site-packages gives a plain Python's; where
    # $PY is itself a venv it would give its base Python's instead, so there $PY's own are added
    # by a .pth file (site.addsitedir also reads the .pth files in them)
    local -a system=(--system-site-packages)
    if "$PY" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)'; then system=(); fi
    "$PY" -m venv "${system[@]}" --without-pip "$VENV" >"$tmp/venv.log" 2>&1 ||
        die "no venv from $PY: $(tail -n1 "$tmp/venv.log")"
    touch "$VENV/$MARK"
    local vpy="$VENV/bin/python"
    "$PY" - "$("$vpy" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" <<'EOF'
import os, site, sys
dirs = site.getsitepackages() + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])
with open(os.path.join(sys.argv[1], "_gpu_offline_base.pth"), "w") as f:
    f.write(f"import site; list(map(site.addsitedir, {dirs!r}))\n")   # (one line, no scope)
EOF
    if ! "$vpy" -m pip --version >/dev/null 2>&1; then
        "$vpy" -m ensurepip >/dev/null 2>&1 || die "$PY has no pip (nor ensurepip)"
    fi
    # pip sees nothing but .gpu_offline/: no index, no configuration, no PIP_* variables
    local -a pip=(env PIP_CONFIG_FILE=/dev/null "$vpy" -m pip --isolated --no-cache-dir
                  --disable-pip-version-check)
    local wheel
    if [[ -n "$rebuild" ]]; then
        say "tinyrt's sources changed since prepare: building its wheel again here ..."
        copy_sources "$tmp/src"
        "${pip[@]}" wheel -q --no-index --no-build-isolation --no-deps -w "$tmp/tinyrt" \
            "$tmp/src" >"$tmp/pip.log" 2>&1 ||
            die "tinyrt's changed sources did not build here: $(pip_error "$tmp/pip.log")"
        wheel=$(ls "$tmp/tinyrt"/tinyrt-*.whl)
    else
        wheel=$(ls "$OFF/tinyrt"/tinyrt-*.whl 2>/dev/null) ||
            die "no tinyrt wheel in .gpu_offline/tinyrt/: run prepare again"
    fi
    say "installing tinyrt into .gpu_offline_venv/ over $PY's packages (no network) ..."
    # tinyrt itself into the venv (even where $PY has a tinyrt), then what it needs and $PY lacks
    "${pip[@]}" install -q --no-index --no-deps --force-reinstall "$wheel" >"$tmp/pip.log" 2>&1 &&
        "${pip[@]}" install -q --no-index --find-links "$OFF/wheels" "$wheel" \
            >"$tmp/pip.log" 2>&1 ||
        die "tinyrt did not install from .gpu_offline/: $(pip_error "$tmp/pip.log")"
    echo "$stamp" >"$VENV/$MARK"
    say "installed, over $PY's packages: $("$vpy" -c 'import importlib.metadata as m, sysconfig
p = sysconfig.get_paths()["purelib"]
print(", ".join(sorted(f"{d.name} {d.version}" for d in m.distributions(path=[p]))))')"
}

case "${1:-}" in
    prepare) [[ $# -eq 1 ]] || usage; prepare ;;
    run) shift; installed; exec "$VENV/bin/python" benchmarks/gpu.py "$@" ;;
    check) shift; installed; exec "$VENV/bin/python" benchmarks/gpu_check.py "$@" ;;
    first) shift; first "$@" ;;
    *) usage ;;
esac
