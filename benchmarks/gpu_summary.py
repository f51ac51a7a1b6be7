"""One summary of `gpu_offline.sh first DIR`: DIR/summary.json, from what each step left in DIR
(`--machine`: the machine's versions, a step of first). It reads DIR/steps.tsv (a line a step:
name, status, exit status, wall seconds, limit, why), machine.out, gpu.out (or, cut short, the
last figures gpu.py put on gpu.err), check-MODEL.out (or its .err's last line), tests.xml (or,
cut short, tests.out's -v lines), and prepare's gpu_static.json (the step model's predictions)
and commit.txt. A failed, cut or skipped step leaves its own part partial or out, never the
others'. Keys: docs/GPU.md. The standard library only (it runs where the install failed too).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def machine() -> dict:
    """The GPU, its driver and CUDA, and the versions of the packages that run the kernels, as
    this machine reports them (a field that cannot be read says why)."""
    import importlib.metadata as meta
    import platform
    import shutil
    import subprocess

    def ask(fn):
        try:
            return fn()
        except Exception as e:                   # noqa: BLE001 (the other fields still stand)
            return f"unknown: {type(e).__name__}: {e}"

    out: dict = {"python": platform.python_version(), "cpus": os.cpu_count(),
                 "platform": platform.platform()}
    for pkg in ("torch", "numba", "numba-cuda", "numpy", "transformers", "tinyrt"):
        out[pkg] = ask(lambda: meta.version(pkg))
    import torch

    out["torch_cuda"] = torch.version.cuda      # (the CUDA torch was built for)
    out["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    if out["gpu"]:
        from numba import cuda

        out["gpu_memory_gib"] = ask(
            lambda: torch.cuda.get_device_properties(0).total_memory / 2**30)
        out["driver_cuda"] = ask(            # (the CUDA the driver supports)
            lambda: ".".join(map(str, cuda.cudadrv.driver.driver.get_version())))
        if shutil.which("nvidia-smi"):
            out["driver"] = ask(lambda: subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20, check=True).stdout.split()[0])
    return out


def read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def last_lines(path: Path) -> dict:
    """The JSON on the last line of each key in `KEY: {...}` lines (a step's stderr)."""
    found = {}
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return found
    for line in text.splitlines():
        if m := re.match(r"(.+?): (\{.*\})$", line):
            try:
                found[m.group(1)] = json.loads(m.group(2))
            except ValueError:
                pass       # (a line cut as the step was stopped)
    return found


def steps(d: Path) -> dict:
    out = {}
    for line in (d / "steps.tsv").read_text().splitlines() if (d / "steps.tsv").exists() else []:
        name, status, rc, wall, limit, why = (line.split("\t", 5) + [""] * 6)[:6]
        out[name] = {"status": status, "rc": int(rc) if rc else None,
                     "wall_s": float(wall) if wall else None,
                     "limit_s": int(limit) if limit else None, **({"why": why} if why else {})}
    return out


def gpu_report(d: Path) -> dict | None:
    """gpu.py's JSON, or where it was cut short, what it said on stderr as it measured."""
    if (r := read_json(d / "gpu.out")) is not None:
        return r
    lines = last_lines(d / "gpu.err")
    if not lines:
        return None
    r = dict(lines.pop("device: copy", {}), models={}, partial=True)
    for key, figures in lines.items():
        name, _, engine = key.partition(": ")
        if engine in ("tinyrt", "transformers"):
            r["models"].setdefault(name, {})[engine] = figures
    return r


def models(r: dict) -> dict:
    """Per model and context: tinyrt's figures beside transformers', and their ratios."""
    out = {}
    for name, m in r.get("models", {}).items():
        t, hf = m.get("tinyrt", {}), m.get("transformers", {})
        s = {k: t[k] for k in ("load_s", "warm_up_s", "weight_mb_per_token", "wall_s") if k in t}
        s.update({f"transformers_{k}": hf[k] for k in ("init_s", "wall_s") if k in hf})
        s.update({k: m[k] for k in ("write_s",) if k in m})
        s.update({f"{who}_{k}": e[k] for who, e in (("tinyrt", t), ("transformers", hf))
                  for k in ("error", "skipped") if k in e})
        s["contexts"] = {}
        for ctx in sorted({*t.get("contexts", {}), *hf.get("contexts", {})}, key=int):
            a, b = t.get("contexts", {}).get(ctx, {}), hf.get("contexts", {}).get(ctx, {})
            c = {k: a[k] for k in ("decode_tok_s", "pct_copy_bw", "gb_s", "prefill_tok_s",
                                   "ttft_s", "runs") if k in a}
            c.update({f"transformers_{k}": b[k] for k in ("decode_tok_s", "prefill_tok_s",
                                                           "ttft_s", "runs") if k in b})
            for k in ("decode", "prefill"):
                if f"{k}_tok_s" in a and b.get(f"{k}_tok_s"):
                    c[f"{k}_ratio_vs_transformers"] = a[f"{k}_tok_s"] / b[f"{k}_tok_s"]
            s["contexts"][str(ctx)] = c
        out[name] = s
    return out


def function(kernel: str) -> str:
    """A kernel's function name: `gemv::q4_gemv` -> q4_gemv (a profile's C++-like names)."""
    return re.split(r"[\[(<]", kernel)[0].split("::")[-1].strip()


def per_layer(p: dict, layers: int, full_layers: int | None) -> dict:
    """A decode step's profile of a `layers`-layer model, its layer kernels' time per layer.

    A kernel launched n times a step is a layer kernel for floor(n / layers) * layers of them
    and once-a-step for the rest, its time shared in proportion (the same kernel at the same
    widths: gpu_check's 4 layers make q4_gemv 16 launches, all in layers; add_rmsnorm 9, 2 a
    layer and the final norm; the head's gemv, argmax and the step's bookkeeping 1, per step).
    With fewer than 2 layers nothing tells them apart: all is per step."""
    out: dict = {k: p[k] for k in ("context", "steps", "error", "wall_us", "gap_us", "launches")
                 if k in p}
    lay, step = out["us_per_layer"], out["us_per_step"] = {}, {}
    for name, k in p.get("kernels", {}).items():
        n = max(round(k["launches"]), 1)
        in_layers = n // layers * layers if layers > 1 else 0
        if in_layers:
            lay[name] = k["us"] * in_layers / n / layers
        if n > in_layers:
            step[name] = k["us"] * (n - in_layers) / n
    out["layer_us"], out["step_us"] = sum(lay.values()), sum(step.values())
    if full_layers and "kernels" in p:      # the full model's kernels a token, and their rate
        out["full_model_us"] = out["layer_us"] * full_layers + out["step_us"]
        out["full_model_kernel_tok_s"] = 1e6 / out["full_model_us"]
    return out


def verdict(g: dict) -> dict:
    if g.get("equal"):
        return {"verdict": "equal", "tokens": g.get("tokens")}
    if "lengths" in g:
        return {"verdict": "fault", "lengths": g["lengths"]}
    return {"verdict": "near tie" if g.get("near_tie") else "fault",
            **{k: g[k] for k in ("step", "cpu_margin", "gpu_margin", "logits_rel_err") if k in g}}


def check(d: Path, name: str, full_layers: int | None) -> tuple[dict, dict]:
    """gpu_check's verdict on `name`, and its profiles per layer (keyed by where they ran)."""
    r = read_json(d / f"check-{name}.out")
    if r is None:
        r = last_lines(d / f"check-{name}.err").get("gpu_check")
    if r is None:
        return {}, {}
    v = {k: r[k] for k in ("agree", "graph_equals_eager", "logits_rel_err", "tokens", "layers",
                           "prompt_tokens", "wall_s") if k in r}
    v["greedy"] = {how: verdict(g) for how, g in r.get("greedy", {}).items()}
    # a prompt's pass on the check's layers, kernel by kernel (its 12 costliest)
    v["prefill_profile"] = {ctx: {**{k: p[k] for k in ("tokens", "launches", "us", "wall_us",
                                                       "error") if k in p},
                                  "kernels": dict(list(p.get("kernels", {}).items())[:12])}
                            for ctx, p in r.get("prefill_at", {}).items()}
    prof = {f"prompt_{how}": p for how, p in r.get("profile", {}).items()}
    prof.update(r.get("profile_at", {}))
    layers = r.get("layers", 0)
    return v, {at: per_layer(p, layers, full_layers) for at, p in prof.items()}


def tests(d: Path, root: Path) -> dict:
    """Counts and failing test ids: from pytest's junit XML, or, where pytest was stopped
    before writing it, from the -v lines it printed as each test ended (their paths from DIR,
    where it ran, made the checkout's, as the XML's are)."""
    ended = []                                  # (test id, passed/failed/errors/skipped)
    try:
        for case in ET.parse(d / "tests.xml").getroot().iter("testcase"):
            f = case.get("file") or case.get("classname", "").replace(".", "/") + ".py"
            cls = case.get("classname", "").split(".")
            mod = f.removesuffix(".py").replace("/", ".").split(".")
            tags = {c.tag for c in case}
            ended.append(("::".join([f, *cls[len(mod):], case.get("name", "")]),
                          "errors" if "error" in tags else "failed" if "failure" in tags
                          else "skipped" if "skipped" in tags else "passed"))
        source = "tests.xml"
    except (OSError, ET.ParseError):
        try:
            text = (d / "tests.out").read_text(errors="replace")
        except OSError:
            return {}
        kinds = {"PASSED": "passed", "XPASS": "passed", "FAILED": "failed", "ERROR": "errors",
                 "SKIPPED": "skipped", "XFAIL": "skipped"}
        up = os.path.relpath(root, d).replace(os.sep, "/") + "/"
        ended = [(m.group(1).removeprefix(up), kinds[m.group(2)]) for m in re.finditer(
            r"^(\S+::.+?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b", text, re.M)]
        source = "tests.out (no tests.xml: cut short?)"
    out: dict = {k: sum(kind == k for _, kind in ended)
                 for k in ("passed", "failed", "errors", "skipped")}
    return {**out, "failing": [t for t, kind in ended if kind in ("failed", "errors")],
            "from": source}


def predictions(static: dict | None, figures: dict, profiles: dict) -> dict:
    """gpu_static.json's step model and predicted_* figures (as they are), and where its
    step_model has models -> NAME -> CONTEXT -> {tok_s, pct_copy_bw, kernels_us_per_layer},
    each beside the measurement (a kernel matched on its function's name; its profile the
    context's, or else the prompt's, named under "at")."""
    if static is None:
        return {"missing": "no .gpu_offline/gpu_static.json (prepare could not run gpu_static.py)"}
    out = {k: v for k, v in static.items()
           if k == "step_model" or k.startswith("predicted_") or k == "model_error_vs_af730b3"}

    def dicts(x):                               # (its structure is not fixed yet)
        return x.items() if isinstance(x, dict) else ()

    vs: dict = {}
    sm = static.get("step_model")
    for name, per_ctx in dicts(sm.get("models") if isinstance(sm, dict) else None):
        for ctx, p in ((c, p) for c, p in dicts(per_ctx) if isinstance(p, dict)):
            meas = figures.get(name, {}).get("contexts", {}).get(str(ctx), {})
            row = {key: {"predicted": p[key], "measured": meas.get(got)} for key, got in (
                ("tok_s", "decode_tok_s"), ("pct_copy_bw", "pct_copy_bw"),
                ("prefill_tok_s", "prefill_tok_s")) if key in p}
            if "ttft_ms" in p:
                row["ttft_ms"] = {"predicted": p["ttft_ms"], "measured": meas.get("ttft_s") and
                                  1e3 * meas["ttft_s"]}
            at = str(ctx) if str(ctx) in profiles.get(name, {}) else "prompt_graph"
            prof = profiles.get(name, {}).get(at, {})
            kernels = {}
            for kname, us in (p.get("kernels_us_per_layer") or {}).items():
                hits = [k for k in prof.get("us_per_layer", {}) if function(k) == function(kname)]
                kernels[kname] = {"predicted": us, "measured": sum(
                    prof["us_per_layer"][k] for k in hits) if hits else None, "profiled": hits}
            if kernels:
                row["kernels_us_per_layer"] = kernels
                row["kernels_at"] = at if prof else None
            vs.setdefault(name, {})[str(ctx)] = row
    if vs:
        out["measured_beside_predicted"] = vs
    return out


def summary(d: Path, args) -> dict:
    st = steps(d)
    names = [n for n in args.models.split(",") if n]

    def ran(step):              # (only the outputs of a step that ran in this run are read)
        return st.get(step, {}).get("status") in ("ok", "failed", "timeout")

    r = (gpu_report(d) if ran("gpu") else None) or {}
    figures = models(r)
    full = {n: (r.get("models", {}).get(n, {}).get("shape") or {}).get("num_hidden_layers")
            for n in names}
    checks, profiles = {}, {}
    for n in names:
        if ran(f"check-{n}"):
            checks[n], profiles[n] = check(d, n, full[n] or 32)     # (both models' 32)
    off = Path(args.offline)

    def prepared(name):
        return (off / name).read_text().strip() if (off / name).exists() else None

    return {
        "status": "complete" if st and all(s["status"] == "ok" for s in st.values())
        else "partial",
        "smoke": args.smoke,
        "machine": (ran("machine") and read_json(d / "machine.out")) or {
            k: r[k] for k in ("device", "torch") if k in r},
        "project": {"commit_at_prepare": prepared("commit.txt"),
                    "sources_sha256": args.sources_sha256,
                    "sources_as_prepared": args.sources_sha256 == prepared("sources.sha256")},
        "budget_s": args.budget,
        "steps": st,
        "steps_wall_s": sum(s["wall_s"] or 0 for s in st.values()),
        "measurement": {"copy_gb_s": r.get("copy_gb_s"), "decode_tokens": r.get("decode_tokens"),
                        "runs": r.get("runs"), "partial": r.get("partial", False),
                        "note": "medians of each context's runs (a median of 2 is their mean); "
                                "each run's figures are in gpu.out"},
        "models": figures,
        "check": {n: c for n, c in checks.items() if c},
        "profile": {n: p for n, p in profiles.items() if p},
        "tests": tests(d, Path(args.root)) if ran("tests") else {},
        "predictions": predictions(read_json(off / "gpu_static.json"), figures, profiles),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", nargs="?", type=Path)
    ap.add_argument("--machine", action="store_true", help="print the machine's versions")
    ap.add_argument("--root", default=".", help="the checkout (the tests' paths are in it)")
    ap.add_argument("--offline", default=".gpu_offline", help="prepare's folder")
    ap.add_argument("--sources-sha256", help="the hash of tinyrt's sources run")
    ap.add_argument("--budget", type=int)
    ap.add_argument("--models", default="llama2-7b,llama3-8b")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.machine:
        print(json.dumps(machine(), indent=1))
        return 0
    if args.dir is None:
        ap.error("DIR, or --machine")
    s = summary(args.dir, args)
    (args.dir / "summary.json").write_text(json.dumps(s, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
