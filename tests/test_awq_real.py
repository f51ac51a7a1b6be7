"""AWQ on the real default model: it must keep well under RTN's perplexity loss on a text it was
not calibrated on (two windows of 2048 tokens of the standard library's docstrings here; the
WikiText-2 figures come from benchmarks/awq_quality.py --text), and
still answer correctly."""

import json

import pytest

import tinyrt
from tinyrt.converters import convert
from tinyrt.perplexity import perplexity

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def smol_rtn(default_gguf, tmp_path_factory):
    return convert(default_gguf, tmp_path_factory.mktemp("smol") / "rtn", method="rtn",
                   requantize=True)


def test_awq_keeps_well_under_rtn_loss(smol_f32, smol_awq, smol_rtn, long_text):
    ppl = {name: perplexity(tinyrt.LLM(d, device="reference"), long_text, ctx=2048, max_windows=2).ppl
           for name, d in [("float", smol_f32), ("awq", smol_awq), ("rtn", smol_rtn)]}
    assert ppl["float"] < ppl["awq"] < ppl["rtn"]
    assert ppl["awq"] - ppl["float"] <= 0.6 * (ppl["rtn"] - ppl["float"]), ppl


def test_awq_model_directory(smol_awq):
    cfg = json.loads((smol_awq / "config.json").read_text())["quantization_config"]
    assert cfg == {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True,
                   "version": "gemm"}   # hidden 576 is not a multiple of 128


def test_awq_golden_answer(smol_awq):
    llm = tinyrt.LLM(smol_awq, device="reference")
    assert llm.generate("What is the capital of France?", temperature=0) == \
        "The capital of France is Paris."
