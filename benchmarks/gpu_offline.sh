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
         "| check [gpu_check.py's options] | first DIR [MODEL,...] [--smoke]" >&2
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
    git -C "$ROOT" describe --always --dirty --abbrev=40 >"$out/commit.txt" 2>/dev/null ||
        echo "(not a git checkout)" >"$out/commit.txt"
    (cd "$out/wheels" && ls) >"$out/wheels.txt"
    # The step model's predictions, for first's summary to set beside what it measures (this
    # needs tinyrt, Numba with libNVVM, ptxas and nvdisasm here; without them, none)
    say "gpu_static.py --json (the step model's predictions) ..."
    "$PY" "$ROOT/benchmarks/gpu_static.py" --json >"$out/gpu_static.json" 2>"$tmp/static.log" ||
        { say "note: gpu_static.py failed, so no predictions in first's summary:" \
              "$(tail -n1 "$tmp/static.log")"; rm -f "$out/gpu_static.json"; }
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

# A GPU machine's first minutes (docs/GPU.md) in one command of under 10 minutes, every figure in
# DIR/summary.json (benchmarks/gpu_summary.py; written also where steps fail or are skipped), each
# step run from DIR (so that python finds the installed tinyrt, not the checkout's tinyrt/), its
# output in DIR/STEP.out and .err, its status and wall seconds in DIR/steps.tsv, a line a step on
# stderr; all by $FIRST_BUDGET seconds from the start (570, the install included). MODELS: gpu.py's
# (llama2-7b,llama3-8b by default), the first checked in full, the others with few tokens. The
# tests: those of the CUDA kernels and the device's decode step, or $GPU_TESTS (paths in the
# checkout). --smoke: the same steps without a GPU (toy models, the CPU device, Numba's simulator).
#
# The limits, from the run at af730b3 (H200): the 7B shape's load took 35.6 s, its 4096-token
# prefill 13.9 s a run (since on the tensor cores: ~0.15 s predicted), its decode 129 tok/s at
# 512 (transformers' 35); the 183 CUDA tests ended within 140 s (the prompt's ~40 more since,
# fast on a GPU). gpu, both models in one process (each figure on gpu.err as measured), ~260 s, a
# model ~130: its files written (7B 3.9 GB, 8B 5.7 GB: 55 s on one core, ~10 s on 16 threads),
# loaded (~36-40 s), warmed up (the CUDA kernels compiled, ~20 s), 3 runs at 512 (~1.5 s each) and
# 2 at 4096 (~16 s each: a third would cost both models 30 s; each run's figures are kept), then
# transformers (~35 s: its init, 3 + 2 runs of ~4 s). check-llama2-7b, ~65 s: the CPU kernels
# compiled (~30 s, a first on the machine), 4 layers on both devices, 64 greedy tokens, profiles
# after the prompt and after 512 and 4096 tokens (4-layer prefills of ~2 s). tests keep their
# 140 s whatever ran over before them; the other models' checks (8 tokens, the same profiles,
# ~40 s) come last, in what is left. ~520 s in all; a step with no time left is skipped.
LIMIT_MACHINE=30 LIMIT_GPU=300 LIMIT_CHECK=120 LIMIT_CHECK_MORE=90
LIMIT_TESTS=${FIRST_TESTS_LIMIT:-140}     # (another test list may need another)
SUMMARY_S=5                     # kept for the summary at the end
first() {
    local dir="" models="" smoke="" a
    for a in "$@"; do
        case "$a" in
            --smoke) smoke=1 ;;
            -*) usage ;;
            *) if [[ -z "$dir" ]]; then dir=$a
               elif [[ -z "$models" ]]; then models=$a
               else usage; fi ;;
        esac
    done
    [[ -n "$dir" ]] || usage
    models=${models:-llama2-7b,llama3-8b}
    [[ "$models" =~ ^[A-Za-z0-9._-]+(,[A-Za-z0-9._-]+)*$ ]] || die "bad model list: $models"
    mkdir -p -- "$dir" 2>/dev/null && dir=$(cd -- "$dir" && pwd -P) || die "no folder $dir"
    local -a tests names
    local t ours="tests/test_gemv_gpu.py tests/test_kernels_gpu.py tests/test_prompt_gpu.py"
    ours+=" tests/test_device_decode.py"
    for t in ${GPU_TESTS:-$ours}; do tests+=("$ROOT/$t"); done
    IFS=, read -ra names <<<"$models"
    local budget=${FIRST_BUDGET:-570} failed=0 ready="" py="$VENV/bin/python" b="$ROOT/benchmarks"
    local deadline=$((SECONDS + budget)) keep=$((LIMIT_TESTS + SUMMARY_S)) ms rc
    # (an earlier run's outputs there are not this one's)
    rm -f -- "$dir"/{steps.tsv,summary.json,tests.xml,install.err} \
        "$dir"/{machine,gpu,tests}.{out,err} "$dir"/check-*.{out,err}
    # the install, its time counted as a step's (installed's failures exit its subshell only)
    ms=$(now_ms)
    set +e
    (set -e; trap cleanup EXIT; installed) 2>"$dir/install.err"
    rc=$?
    set -e
    cat "$dir/install.err" >&2
    if [[ $rc -eq 0 ]]; then
        ready=1
        record install ok 0 "$ms" ""
    else
        failed=1
        record install failed "$rc" "$ms" "" "$(tail -n1 "$dir/install.err")"
    fi
    # (the checks after the first with few tokens: their profiles are the point)
    local -a gpu=(--json --runs 3,2) check=(--json --profile-contexts 512,4096) few=(--tokens 8)
    [[ -z "$smoke" ]] || gpu=(--json --device cpu --smoke) check=(--json --smoke)
    step "$LIMIT_MACHINE" "$keep" machine "$py" "$b/gpu_summary.py" --machine
    step "$LIMIT_GPU" "$keep" gpu "$py" "$b/gpu.py" --models "$models" "${gpu[@]}"
    step "$LIMIT_CHECK" "$keep" "check-${names[0]}" \
        "$py" "$b/gpu_check.py" --model "${names[0]}" "${check[@]}"
    step "$LIMIT_TESTS" "$SUMMARY_S" tests "$py" -m pytest -v -p no:cacheprovider \
        --junitxml=tests.xml -o junit_family=xunit1 --rootdir "$ROOT" "${tests[@]}"
    for a in "${names[@]:1}"; do
        step "$LIMIT_CHECK_MORE" "$SUMMARY_S" "check-$a" \
            "$py" "$b/gpu_check.py" --model "$a" "${check[@]}" "${few[@]}"
    done
    # the summary: with the machine's Python (the standard library only), even with no venv
    local spy=$PY
    command -v "$spy" >/dev/null || spy=python3
    "$spy" "$b/gpu_summary.py" "$dir" --root "$ROOT" --offline "$OFF" --budget "$budget" \
        --models "$models" \
        --sources-sha256 "$(sources_hash "$spy" 2>/dev/null)" ${smoke:+--smoke} ||
        { say "summary: failed"; failed=1; }
    [[ -f "$dir/summary.json" ]] && say "summary: $dir/summary.json"
    return "$failed"
}

# Milliseconds since the epoch (bash 5's EPOCHREALTIME; whole seconds before it).
now_ms() {
    local t=${EPOCHREALTIME:-}
    if [[ -n "$t" ]]; then
        t=${t/[.,]/}
        echo $((10#$t / 1000))
    else
        echo $(($(date +%s) * 1000))
    fi
}

# record NAME STATUS RC START_MS LIMIT [WHY]: a line of $dir/steps.tsv (for the summary)
record() {
    local ms=$(( $(now_ms) - $4 )) why=${6:-}
    printf '%s\t%s\t%s\t%d.%03d\t%s\t%s\n' "$1" "$2" "$3" $((ms / 1000)) $((ms % 1000)) "$5" \
        "${why//[$'\t\n']/ }" >>"$dir/steps.tsv"
}

# step LIMIT KEEP NAME CMD...: CMD run from $dir within LIMIT seconds, less where $deadline less
# KEEP seconds (kept for the steps after it) is nearer, its output in $dir/NAME.out and .err; a
# failure sets $failed (first's). Without $ready (the install failed) it is skipped.
step() {
    local limit=$1 keep=$2 name=$3 start=$SECONDS ms rc=0
    shift 3
    ms=$(now_ms)
    (( limit > deadline - keep - SECONDS - 5 )) && limit=$((deadline - keep - SECONDS - 5))
    if [[ -z "$ready" ]] || (( limit < 1 )); then
        local why="no time left"
        [[ -n "$ready" ]] || why="the install failed"
        say "$name: skipped: $why"
        record "$name" skipped "" "$ms" "" "$why"
        failed=1
        return
    fi
    say "$name: $* (at most $limit s) ..."
    (cd "$dir" && PYTHONUNBUFFERED=1 timeout -k 5 "$limit" "$@" >"$name.out" 2>"$name.err") ||
        rc=$?
    local took=$((SECONDS - start))
    if [[ $rc -eq 0 ]]; then
        say "$name: done in $took s"
        record "$name" ok 0 "$ms" "$limit"
        return
    fi
    failed=1
    if [[ ($rc -eq 124 || $rc -eq 137) && $took -ge $limit ]]; then
        say "$name: stopped at its limit of $limit s"
        record "$name" timeout "$rc" "$ms" "$limit" "stopped at its limit"
    else
        local why
        why=$(tail -n1 "$dir/$name.err")
        [[ -n "$why" ]] || why=$(tail -n1 "$dir/$name.out")
        say "$name: failed (exit status $rc) in $took s: $why"
        record "$name" failed "$rc" "$ms" "$limit" "$why"
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
