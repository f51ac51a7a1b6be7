"""benchmarks/gpu_check.py, the GPU's greedy tokens against the CPU's: where two token lists part,
the margins there say whether it was a near tie (the order of float sums) or a fault. Here two
different random models on the CPU device stand for a faulty GPU path."""

import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def check(tmp_path_factory):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return gpu_check


def test_a_parting_is_placed_and_weighed(check, tmp_path):
    import tinyrt

    gpu = check.gpu
    good = gpu.awq_model(tmp_path, "m", check.SMOKE_SHAPE, smoke=True)
    bad = tmp_path / "other"
    bad.mkdir()
    for f in good.iterdir():
        if f.suffix == ".json":
            (bad / f.name).write_bytes(f.read_bytes())
    gpu.write_safetensors(bad / "model.safetensors", gpu.model_tensors(check.SMOKE_SHAPE, seed=1))
    cpu, other = (tinyrt.load(str(p), device="cpu", threads=1, quiet=True) for p in (good, bad))
    ids = cpu.encode(check.PROMPT)[:8]
    want, got = check.greedy(cpu, ids, 12), check.greedy(other, ids, 12)
    assert len(want) == len(got) == 12 and len(set(want)) > 3     # (centred codes: tokens vary)
    assert check.parting(cpu, cpu, ids, want, list(want), 0.01) == {"equal": True, "tokens": 12}
    assert check.parting(cpu, cpu, ids, want[:-1], want, 0.01) == {
        "equal": False, "lengths": [11, 12], "near_tie": False}

    p = check.parting(other, cpu, ids, got, want, 0.01)
    k = next(i for i in range(12) if got[i] != want[i])
    assert not p["equal"] and p["step"] == k
    assert (p["cpu_token"], p["gpu_token"]) == (want[k], got[k])
    # each device's own token wins on its own logits, by far more than a near tie's 1 %
    assert p["cpu_margin"] > 0.01 and p["gpu_margin"] > 0.01 and not p["near_tie"]
    assert p["logits_rel_err"] > 0.1
    assert check.parting(other, cpu, ids, got, want, 1e9)["near_tie"]
    # a near tie needs both margins under it (each model as the GPU, so that each margin is
    # the larger one once)
    for fast, slow, a, b in ((other, cpu, got, want), (cpu, other, want, got)):
        q = check.parting(fast, slow, ids, a, b, 0.01)
        for tie in (q["cpu_margin"] * 1.001, q["gpu_margin"] * 1.001):
            near = max(q["cpu_margin"], q["gpu_margin"]) < tie
            assert check.parting(fast, slow, ids, a, b, tie)["near_tie"] == near


def test_random_codes_are_centred_on_the_zero_point(check):
    """gpu.py's random 4-bit codes: a code 0 becomes 8, the others stay, so their mean is the
    zero point 8 (at Llama-2-7B's width, uniform codes gave 2 distinct tokens in 32 greedy
    ones of a 4-layer model, centred codes 32)."""
    import numpy as np

    raw = np.random.default_rng(5).bytes(4 * 4096)
    before = np.frombuffer(raw, np.uint32)
    after = check.gpu.centred(raw).view(np.uint32)

    def codes(w):
        return np.stack([(w >> k) & 15 for k in range(0, 32, 4)])

    a, b = codes(before), codes(after)
    assert (b == np.where(a == 0, 8, a)).all() and (a == 0).sum() > 1000
    assert abs(b.mean() - 8) < 0.05


def test_model_files_are_the_same_whichever_threads_write_them(check, tmp_path):
    """gpu.py's model writer makes each chunk from a seed of its own, on several threads, and
    writes them in order: the same bytes on 1 thread or 3, whatever order chunks finish in (a
    shared generator would hand out its numbers in the threads' order), and a model's first
    layers are those of a deeper one (gpu_check's 4-layer copies are the full model's, the
    output projections' scales but for their depth's factor)."""
    import numpy as np

    gpu = check.gpu
    shape = dict(check.SMOKE_SHAPE, vocab_size=9000)         # (the embedding in 3 chunks)
    files = []
    for threads in (1, 3):
        files.append(tmp_path / f"{threads}.safetensors")
        gpu.write_safetensors(files[-1], gpu.model_tensors(shape), threads=threads)
    assert files[0].read_bytes() == files[1].read_bytes()
    # chunks made in reverse order still land in order
    tensors = gpu.model_tensors(shape)
    slow = [(n, d, s, [lambda make=make, k=k: (time.sleep(0.02 * (9 - k)), make())[1]
                       for k, make in enumerate(chunks)]) for n, d, s, chunks in tensors]
    gpu.write_safetensors(tmp_path / "slow.safetensors", slow, threads=4)
    assert (tmp_path / "slow.safetensors").read_bytes() == files[0].read_bytes()

    def arrays(layers):
        return {name: np.concatenate([np.asarray(make()).ravel() for make in chunks])
                for name, _, _, chunks in gpu.model_tensors(dict(shape, num_hidden_layers=layers))}

    one, two = arrays(1), arrays(2)
    assert set(one) < set(two)
    # (the output projections' scales follow the depth: std / sqrt(2 L))
    same = [n for n in one if "o_proj.scales" not in n and "down_proj.scales" not in n]
    assert all(np.array_equal(one[n], two[n]) for n in same)
    assert len(set(one["model.embed_tokens.weight"][:4096].tolist())) > 1000
