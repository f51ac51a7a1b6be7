"""llama.cpp's own files, from the llama-cpp-python sdist: its vocabulary-only GGUFs with their
tokenizer test vectors (`models/ggml-vocab-NAME.gguf`, `.inp`, `.out`), its collection of chat
templates (`models/templates/`) and its HF -> GGUF converter (`convert_hf_to_gguf.py` with
`conversion/` and `gguf-py/`). Fetched with pip once (about 77 MB) and kept, those files only,
in the user cache."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VERSION = "0.3.36"
SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
ROOT = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
KEEP = ("models/ggml-vocab-", "models/templates/", "convert_hf_to_gguf.py", "conversion/",
        "gguf-py/gguf/")
SEPARATOR = "\n__ggml_vocab_test__\n"


def llama_cpp_dir() -> Path:
    """The folder of llama.cpp's files kept (KEEP), laid out as in its repository."""
    import platformdirs

    dest = Path(platformdirs.user_cache_dir("tinyrt")) / "test-data" / f"llama.cpp-{VERSION}"
    if (dest / "complete").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                        "--no-binary", ":all:", f"llama-cpp-python=={VERSION}", "-d", tmp],
                       check=True, timeout=1800, stdin=subprocess.DEVNULL)
        sdist = Path(tmp) / f"llama_cpp_python-{VERSION}.tar.gz"
        digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
        assert digest == SHA256, f"{sdist.name}: sha256 {digest}, expected {SHA256}"
        out = Path(tmp) / "llama.cpp"
        with tarfile.open(sdist) as tar:
            for m in tar:
                name = m.name[len(ROOT):] if m.name.startswith(ROOT) else ""
                if m.isfile() and ".." not in name.split("/") and name.startswith(KEEP):
                    target = out / name
                    target.parent.mkdir(parents=True, exist_ok=True)
                    with tar.extractfile(m) as src, open(target, "wb") as f:
                        shutil.copyfileobj(src, f)
        (out / "complete").write_text(f"llama-cpp-python {VERSION} {SHA256}\n")
        if dest.exists():                  # (an earlier fetch cut short: no "complete" in it)
            shutil.rmtree(dest)
        os.replace(out, dest)
    return dest


def vocab_vectors(name: str) -> tuple[Path, list[tuple[str, list[int]]]]:
    """`ggml-vocab-NAME.gguf` and its test vectors: (text, llama.cpp's ids without BOS)."""
    d = llama_cpp_dir() / "models"
    texts = (d / f"ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8").split(SEPARATOR)
    ids = (d / f"ggml-vocab-{name}.gguf.out").read_text(encoding="utf-8").split("\n")
    assert len(ids) >= len(texts), name
    return d / f"ggml-vocab-{name}.gguf", [(t, [int(x) for x in i.split()])
                                           for t, i in zip(texts, ids)]


# Runs llama.cpp's converter. A byte-level BPE vocabulary it does not know by its hash (a test's
# tokenizer) is written under the pre-tokenizer name given, as it writes a known one.
CONVERT = """
import sys
from pathlib import Path
script, pre, *args = sys.argv[1:]
sys.argv = [script, *args]
root = Path(script).parent
sys.path[:0] = [str(root), str(root / "gguf-py")]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
import convert_hf_to_gguf
convert_hf_to_gguf.main()
"""


def convert_with_llama_cpp(model: Path, out: Path, outtype: str = "f32",
                           pre: str = "gpt-2", timeout: float = 600) -> Path:
    """`model` (an HF directory) -> the GGUF llama.cpp's convert_hf_to_gguf.py writes of it
    (`outtype`: f32, f16, bf16 or q8_0, its own quantizer), within `timeout` seconds."""
    script = llama_cpp_dir() / "convert_hf_to_gguf.py"
    p = subprocess.run([sys.executable, "-c", CONVERT, str(script), pre, str(model),
                        "--outfile", str(out), "--outtype", outtype],
                       capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                       env={**os.environ, "NO_LOCAL_GGUF": "1"})
    assert p.returncode == 0 and out.is_file(), p.stderr[-3000:]
    return out
