"""This checkout against an earlier git revision, side by side in one run: `tinyrt bench` of each
model under each revision, taking turns round after round (a change in the machine's load falls
on both alike); medians of load seconds, prefill and decode tok/s, and their ratios (this / base). For a
change that must cost nothing (a refactoring), the ratios should sit at 1 within the noise.

    python benchmarks/revisions.py --base REV [MODEL ...] [--rounds 5] [--threads 2]

The base revision is checked out with `git worktree` into a temporary directory and imported
from there (the packages of the repository root laid out as they install); MODEL defaults to
the default model.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# how the repository root installs (pyproject.toml's package-dir)
PACKAGES = {"models": "models", "kernels": "kernels", "converters": "converters"}


def package_tree(checkout: Path, into: Path) -> Path:
    """A directory to put on PYTHONPATH so that `import tinyrt` imports `checkout`'s files: a
    tinyrt/ of links to its tinyrt/ files and to its root's models/, kernels/, converters/."""
    pkg = into / "tinyrt"
    pkg.mkdir(parents=True)
    for entry in (checkout / "tinyrt").iterdir():
        (pkg / entry.name).symlink_to(entry)
    for name, folder in PACKAGES.items():
        (pkg / name).symlink_to(checkout / folder)
    return into


def bench(path: Path, model: str | None, args) -> dict:
    env = dict(os.environ, PYTHONPATH=str(path))
    cmd = [sys.executable, "-m", "tinyrt", "bench", *([model] if model else []), "--json",
           "--threads", str(args.threads), "--runs", str(args.runs),
           "--prompt-tokens", str(args.prompt_tokens), "--decode-tokens", str(args.decode_tokens)]
    # run from the tree's own folder: `python -m` puts the working directory first on the path,
    # and run from the repository its tinyrt/ (and, through the editable install, its kernels)
    # would be imported for every revision alike
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=path)
    if out.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{out.stderr}")
    return json.loads(out.stdout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="*", default=[None])
    p.add_argument("--base", required=True, help="the git revision to compare against")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--runs", type=int, default=3, help="tinyrt bench --runs, each turn")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=128)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        base = tmp / "checkout"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base), args.base],
                       check=True, capture_output=True)
        try:
            trees = {"base": package_tree(base, tmp / "base"), "this": package_tree(ROOT, tmp / "this")}
            figures = {(m, r): [] for m in args.models for r in trees}
            for model in args.models:            # (a first turn each compiles the kernels)
                for tree in trees.values():
                    bench(tree, model, args)
            for i in range(args.rounds):
                for model in args.models:
                    for rev, tree in trees.items():
                        figures[model, rev].append(bench(tree, model, args))
                print(f"round {i + 1} of {args.rounds} done", file=sys.stderr)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)],
                           capture_output=True)
    for model in args.models:
        print(f"{model or 'default model'} ({args.rounds} rounds, {args.threads} threads, "
              f"prompt {args.prompt_tokens}, decode {args.decode_tokens}):")
        for key in ("load_s", "prefill_tok_s", "decode_tok_s"):
            med = {r: statistics.median(f[key] for f in figures[model, r]) for r in trees}
            ratios = [a[key] / b[key] for a, b in zip(figures[model, "this"], figures[model, "base"])]
            print(f"  {key:14s} base {med['base']:8.1f}  this {med['this']:8.1f}  "
                  f"ratio {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()
