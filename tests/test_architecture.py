"""The arrows of docs/ARCHITECTURE.md, checked: front ends -> runtime -> models -> kernels, the
converter beside them and never imported by the runtime; `import tinyrt` stays cheap."""

import ast
import json
import subprocess
import sys
from pathlib import Path

from helpers import write_tiny_model

ROOT = Path(__file__).resolve().parent.parent
# the front ends: they resolve names and files to model directories, and may convert
FRONT_ENDS = {"tinyrt/registry.py"} | {str(p.relative_to(ROOT)) for p in (ROOT / "tinyrt/cli").glob("*.py")}
ROOMS = {"kernels": "tinyrt.kernels", "models": "tinyrt.models", "converters": "tinyrt.converters"}


def package_of(path: Path) -> str:
    """The package `path` (a file of tinyrt) lies in, or for an __init__.py, that it defines."""
    rel = path.relative_to(ROOT)
    return ".".join((ROOMS.get(rel.parts[0], "tinyrt"), *rel.parts[1:-1]))


def module_name(path: Path) -> str:
    """The name `path` (a file of the package) imports as."""
    package = package_of(path)
    return package if path.name == "__init__.py" else f"{package}.{path.stem}"


def imports(path: Path, *, typing_only: bool = True) -> set[str]:
    """Every module a file imports, at its top or inside a function, as absolute names (with
    typing_only=False, not those under `if TYPE_CHECKING:`, which never run)."""
    package = package_of(path)
    tree = ast.parse(path.read_text())
    skip = set() if typing_only else {
        id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
        and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
        for part in node.body for n in ast.walk(part)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(p for p in (base, node.module) if p)
            found.add(module)
            found |= {f"{module}.{a.name}" for a in node.names}
    return found


def files(room: str):
    return sorted(p for p in (ROOT / room).rglob("*.py") if "__pycache__" not in p.parts)


def test_the_arrows_point_one_way():
    for path in files("kernels"):
        assert not {m for m in imports(path) if m.startswith("tinyrt")
                    and not m.startswith("tinyrt.kernels")}, path
    for path in files("models"):
        # (errors, memory and paths: leaves that import nothing else of the package)
        bad = {m for m in imports(path) if m.startswith("tinyrt") and not m.startswith(
            ("tinyrt.kernels", "tinyrt.models", "tinyrt.errors", "tinyrt.memory", "tinyrt.paths"))}
        assert not bad, (path, bad)
    for leaf in ("errors", "memory", "paths"):       # errors imports nothing of the package
        path = ROOT / "tinyrt" / f"{leaf}.py"
        assert all(m == "tinyrt.errors" or m.startswith("tinyrt.errors.") and leaf != "errors"
                   for m in imports(path) if m.startswith("tinyrt")), path
    for path in files("tinyrt"):
        if str(path.relative_to(ROOT)) not in FRONT_ENDS:
            bad = {m for m in imports(path) if m.startswith("tinyrt.converters")}
            assert not bad, (path, bad)
    front = FRONT_ENDS | {"tinyrt/server.py", "tinyrt/__main__.py"}
    for path in files("tinyrt"):       # the runtime knows nothing of the front ends
        if str(path.relative_to(ROOT)) not in front:
            bad = {m for m in imports(path) if m.startswith(("tinyrt.cli", "tinyrt.server"))}
            assert not bad, (path, bad)


def test_every_module_is_on_the_map():
    """docs/ARCHITECTURE.md's module map names every module of the four rooms by its path."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    mapped = text[text.index("## Module map"):]
    missing = [str(p.relative_to(ROOT)) for room in ("tinyrt", *ROOMS) for p in files(room)
               if f"`{p.relative_to(ROOT)}`" not in mapped]
    assert not missing, f"modules missing from docs/ARCHITECTURE.md's map: {missing}"


def test_every_package_is_installed():
    """pyproject's packages are every folder of the four rooms that holds an __init__.py: one
    left out would be missing from a wheel (the editable install finds it all the same)."""
    import tomllib

    listed = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    found = {package_of(p) for room in ("tinyrt", *ROOMS) for p in files(room)
             if p.name == "__init__.py"}
    assert sorted(listed) == sorted(found)


def test_no_import_runs_in_a_circle():
    """No chain of imports (at a file's top or inside a function) leads from a module back to
    itself: each module can be read knowing only those below it."""
    paths = [p for room in ("tinyrt", *ROOMS) for p in files(room)]
    names = {module_name(p): p for p in paths}
    graph = {m: {i for i in imports(p, typing_only=False) if i in names and i != m
                 and not m.startswith(i + ".")}          # (a package runs before its modules)
             for m, p in names.items()}
    done, path = set(), []

    def visit(m):
        if m in path:
            raise AssertionError("imports in a circle: " + " -> ".join(path[path.index(m):] + [m]))
        if m not in done:
            path.append(m)
            for i in sorted(graph[m]):
                visit(i)
            path.pop()
            done.add(m)

    for m in sorted(graph):
        visit(m)


def test_a_loaded_model_runs_without_the_converter(tmp_path):
    """`tinyrt.load` of a model directory, and a reply, import nothing of the converter; and
    `import tinyrt` alone imports neither NumPy nor the kernels."""
    d = write_tiny_model(tmp_path / "m")
    script = (
        "import sys, json, tinyrt\n"
        "cheap = sorted(m for m in ('numpy', 'numba', 'tinyrt.kernels') if m in sys.modules)\n"
        f"llm = tinyrt.load({str(d)!r}, device='cpu')\n"
        "text = llm.generate('hello', max_tokens=5)\n"
        "print(json.dumps([cheap, 'tinyrt.converters' in sys.modules, 'tinyrt.api' in sys.modules]))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    cheap, converter, ran = json.loads(out.stdout.splitlines()[-1])
    assert cheap == [] and ran and not converter


def test_the_command_line_starts_without_numba():
    """Building every command's parser (`tinyrt --help`, a typo's usage line) loads neither
    Numba nor the converters' compiled code (they cost a third of a second before anything), nor
    the server's web stack."""
    script = ("import sys, json\nfrom tinyrt.cli import build_parser\nbuild_parser()\n"
              "print(json.dumps(sorted(m for m in ('numba', 'tinyrt.converters.awq',"
              " 'tinyrt.kernels.cpu', 'starlette', 'uvicorn') if m in sys.modules)))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.splitlines()[-1]) == []


def test_every_document_the_code_cites_is_in_the_repository():
    """A page named in the code, the tests or the docs (`docs/DESIGN.md`, `ARCHITECTURE.md`, ...)
    is a file of this repository, found from a lone clone."""
    import re

    sources = [*ROOT.glob("*.md"), *ROOT.glob("docs/*.md"), *ROOT.glob("tests/*.py"),
               *ROOT.glob("benchmarks/*.py"),
               *(p for room in ("tinyrt", "models", "kernels", "converters") for p in files(room))]
    cited = set()
    for path in sources:
        cited |= set(re.findall(r"(?<![\w/.-])((?:docs/)?[A-Z][A-Za-z_]+\.md)\b", path.read_text()))
    assert "docs/DESIGN.md" in cited
    missing = sorted(c for c in cited if not (ROOT / c).is_file() and not (ROOT / "docs" / c).is_file())
    assert not missing, missing
