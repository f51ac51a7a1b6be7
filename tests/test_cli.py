"""The command line as a user runs it: the real `tinyrt` command in a subprocess."""

import json
import shutil
import signal
import subprocess
import sys
import time

import pytest

from helpers import assert_refused, run_tinyrt, tiny_config, write_tiny_model


def tinyrt(*args, input=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "tinyrt", *args], input=input, capture_output=True,
                          text=True, timeout=timeout)


def _one_line_error(p, words):
    assert p.returncode == 1, p.stderr
    assert "Traceback" not in p.stderr
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("tinyrt: error:"), p.stderr
    assert words in lines[0], lines[0]


@pytest.mark.real_model
def test_generate_default_model(smol):
    p = tinyrt("generate", "What is the capital of France?", "--temperature", "0", "--stats")
    assert p.returncode == 0, p.stderr
    assert "Paris" in p.stdout
    assert "prefill" in p.stderr and "decode" in p.stderr and "ttft" in p.stderr


@pytest.mark.real_model
def test_generate_json_contract(smol):
    p = tinyrt("generate", "-m", str(smol), "Count to three.", "--json", "-n", "8", "--seed", "1")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert set(out) >= {"text", "tokens", "finish_reason", "timings"}
    assert set(out["timings"]) >= {"load_s", "ttft_s", "prefill_tok_s", "decode_tok_s"}
    assert out["tokens"] <= 8 and out["finish_reason"] in ("stop", "length")


@pytest.mark.real_model
def test_chat_over_piped_stdin(smol):
    p = tinyrt("chat", "--temperature", "0", input="What is the capital of France?\nAnd of Spain?\n")
    assert p.returncode == 0, p.stderr
    assert "Paris" in p.stdout and "Madrid" in p.stdout


@pytest.mark.real_model
def test_info(smol, smol_f32):
    """Per kind of tensor: how it is stored and what it runs as."""
    p = tinyrt("info", str(smol_f32))
    assert p.returncode == 0 and "num_key_value_heads" in p.stdout and "F32" in p.stdout
    p = tinyrt("info")                                   # the default model: its GGUF
    assert p.returncode == 0, p.stderr
    rows = {line.split()[0]: line for line in p.stdout.splitlines() if line.strip()}
    assert "Q4_1" in rows["self_attn.q_proj"] and "W4A16" in rows["self_attn.q_proj"]
    assert "Q8_0" in rows["lm_head"] and "W8A16" in rows["lm_head"]


def test_errors_are_one_clear_line(tmp_path):
    d = write_tiny_model(tmp_path / "ok", tiny_config())
    _one_line_error(tinyrt("generate", "-m", str(tmp_path / "nope"), "hi"), "neither a file")
    _one_line_error(tinyrt("generate", "-m", "no-such-model", "hi"), "known name")
    _one_line_error(tinyrt("info", "no-such-model"), "known name")

    trunc = tmp_path / "trunc"
    trunc.mkdir()
    for f in d.iterdir():
        (trunc / f.name).write_bytes(f.read_bytes())
    st = trunc / "model.safetensors"
    st.write_bytes(st.read_bytes()[:-1000])
    _one_line_error(tinyrt("generate", "-m", str(trunc), "hi"), "truncated")

    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"this is not a model at all" * 10)
    _one_line_error(tinyrt("generate", "-m", str(fake), "hi"), "not a GGUF file")

    for name, change, words in [("arch", {"model_type": "gpt_neox"}, "unsupported architecture"),
                                ("heads", {"num_key_value_heads": 4}, "multiple of num_key_value_heads")]:
        bad = tmp_path / name
        bad.mkdir()
        for f in d.iterdir():
            (bad / f.name).write_bytes(f.read_bytes())
        cfg = json.loads((bad / "config.json").read_text())
        cfg.update(change)
        (bad / "config.json").write_text(json.dumps(cfg))
        _one_line_error(tinyrt("generate", "-m", str(bad), "hi"), words)

    _one_line_error(tinyrt("generate", "-m", str(d), "hi " * 50, "--kv-size", "16"), "prompt has")
    _one_line_error(tinyrt("convert", str(d), str(d)), "refusing to write over the source")
    _one_line_error(tinyrt("convert", str(d), str(tmp_path / "o"), "--max-shard-size", "0GB"),
                    "not a size")
    _one_line_error(tinyrt("generate", "-m", str(d), "hi", "--top-p", "2"), "top-p")
    _one_line_error(tinyrt("generate", "-m", str(d), "hi", "--kv-size", "64", "--kv-mem", "1MB"),
                    "not both")
    _one_line_error(tinyrt("generate", "-m", str(d), "hi", "--kv-mem", "100B"), "holds no token")
    _one_line_error(tinyrt("generate", "-m", str(d), "hi", "--kv-mem", "lots"), "not a size")
    p = tinyrt("generate", "-m", str(d), "hi", "--kv-mem", "64KB", "--max-tokens", "3")
    assert p.returncode == 0, p.stderr
    _one_line_error(tinyrt("generate", "-m", str(d), "hi", "--kv-type", "q4", "--kv-group", "3"),
                    "power of two")
    p = tinyrt("generate", "-m", str(d), "hi", "--kv-type", "q2", "--kv-group", "4",
               "--kv-residual", "0", "--max-tokens", "8", "--json")
    assert p.returncode == 0, p.stderr
    p = tinyrt("info", str(d))
    assert p.returncode == 0 and "KV cache" in p.stdout and "KiB per token" in p.stdout, p.stdout


@pytest.mark.real_model
@pytest.mark.parametrize("sig, at", [(signal.SIGINT, 0.4), (signal.SIGKILL, 0.0), (signal.SIGKILL, 0.5),
                                     (signal.SIGKILL, 0.95)])
def test_convert_killed_leaves_all_or_nothing(tmp_path, default_gguf, sig, at):
    """A real conversion killed at a point `at` (a fraction of the time it takes) leaves either
    no output or a complete one that loads; never a part. A later conversion sweeps what a killed
    one left behind."""
    from tinyrt.models import WeightStore

    cmd = [sys.executable, "-m", "tinyrt", "convert", str(default_gguf), str(tmp_path / "out"),
           "--method", "none", "--dtype", "f32"]
    start = time.perf_counter()
    assert subprocess.run(cmd + ["--force"], capture_output=True).returncode == 0
    took = time.perf_counter() - start
    out = tmp_path / "out"
    whole = sorted(WeightStore(out).keys())
    shutil.rmtree(out)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    time.sleep(at * took)
    proc.send_signal(sig)
    proc.wait(timeout=60)
    if out.exists():              # it had renamed its output in place: the whole model is there
        # (a kill after the rename, while the process exits, still ends it with the signal)
        assert sorted(WeightStore(out).keys()) == whole and (out / "config.json").exists()
    else:
        assert proc.returncode != 0
    if sig == signal.SIGINT and proc.returncode != 0:     # cleaned up on the way out
        assert list(tmp_path.iterdir()) == []
    p = tinyrt("convert", str(default_gguf), str(out), "--method", "none", "--dtype", "f16", "--force")
    assert p.returncode == 0, p.stderr
    assert sorted(x.name for x in tmp_path.iterdir()) == ["out"]


# -- bad values of the generation options, bad bytes: one line, before the model loads -----------

@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("cli") / "m", tiny_config(), seed=3)


@pytest.mark.parametrize("args, words", [
    (["--seed", "-2"], ["--seed", "-2"]), (["--seed", "1.5"], ["--seed"]),
    (["--top-k", "2.5"], ["--top-k", "integer"]), (["--top-k", "-1"], ["--top-k"]),
    (["--temperature", "nan"], ["--temperature"]), (["--temperature", "hot"], ["--temperature"]),
    (["--temperature", "1e999"], ["--temperature"]), (["--top-p", "0"], ["--top-p"]),
    (["--min-p", "-0.1"], ["--min-p"]), (["--repeat-penalty", "0"], ["--repeat-penalty"]),
    (["-n", "0"], ["--max-tokens"]), (["--max-tokens", "9" * 30], ["--max-tokens"]),
    (["--stop", ""], ["--stop"]), (["--device", "tpu"], ["--device"]),
    # the cache's and the runtime's options
    (["--kv-size", "0"], ["--kv-size"]), (["--kv-size", "-3"], ["--kv-size"]),
    (["--kv-size", str(1 << 40)], ["--kv-size"]), (["--sinks", "-1"], ["--sinks"]),
    (["--recent", "0"], ["--recent"]), (["--kv-group", "0"], ["--kv-group"]),
    (["--kv-residual", "-1"], ["--kv-residual"]), (["--kv-mem", "0MB"], ["not a size"]),
    (["--kv-policy", "sink", "--kv-size", "4"], ["--sinks 4", "size 4"]),
    (["--kv-policy", "h2o", "--kv-size", "16", "--recent", "13"], ["--recent 13"]),
    (["--threads", "0"], ["--threads"]), (["--threads", "100000"], ["--threads", "CPUs"]),
    (["--draft-tokens", "0"], ["--draft-tokens"]), (["--draft-tokens", "33"], ["--draft-tokens"]),
])
def test_bad_generation_options_are_refused_before_loading(tmp_path, args, words):
    """The model named does not exist: the option is what is refused, so it was checked first."""
    p = run_tinyrt("generate", "-m", str(tmp_path / "no-model"), "hi", *args)
    assert_refused(p, *words)


@pytest.mark.parametrize("args, words", [
    (["chat", "--threads", "100000"], ["--threads"]), (["chat", "--kv-size", "0"], ["--kv-size"]),
    (["bench", "--threads", "0"], ["--threads"]), (["bench", "--draft-tokens", "99"], ["--draft-tokens"]),
    (["ppl", "--text", "t.txt", "--kv-size", "0"], ["--kv-size"]),
    (["ppl", "--text", "t.txt", "--ctx", "1"], ["--ctx"]),
    (["ppl", "--text", "t.txt", "-c", "1"], ["--ctx"]),         # llama-perplexity's -c: the window
    (["run", "--threads", "0"], ["--threads"]), (["run", "hi", "-c", "0"], ["--kv-size"]),
    (["ppl", "--text", "t.txt", "--threads", "100000"], ["--threads"]),
    (["serve", "--port", "70000"], ["--port"]), (["serve", "--max-queue", "-1"], ["--max-queue"]),
    (["serve", "--max-body", "0"], ["--max-body"]), (["serve", "--sinks", "-2"], ["--sinks"]),
])
def test_every_command_checks_its_options_before_loading(tmp_path, args, words):
    p = run_tinyrt(*args[:1], str(tmp_path / "no-model"), *args[1:], input=b"")
    assert_refused(p, *words)


@pytest.mark.parametrize("args, line", [
    (["generate", "--temprature", "0.5", "Hi"],
     "unknown option --temprature (did you mean --temperature?)"),
    (["generate", "Hi", "--temprature=0.5"],
     "unknown option --temprature (did you mean --temperature?)"),
    (["chta"], "unknown command chta (did you mean chat?)"),
    (["ppl", "--txt", "f.txt"], "unknown option --txt (did you mean --text?)"),
    (["generate", "--temperature", "0", "--kv-sise", "8"],
     "unknown option --kv-sise (did you mean --kv-size?)"),
    (["--temperature", "0", "generate", "Hi"],
     "unknown option --temperature (options go after the command: tinyrt COMMAND --temperature ...)"),
    # llama.cpp's spellings, misspelled
    (["generate", "Hi", "--ctx-sise", "64"],
     "unknown option --ctx-sise (did you mean --ctx-size?)"),
    (["generate", "Hi", "--context-size", "64"],
     "unknown option --context-size (did you mean --ctx-size?)"),
    (["generate", "Hi", "--n_predict", "4"],
     "unknown option --n_predict (did you mean --n-predict?)"),
    (["chat", "--ngl", "99"], "unknown option --ngl (did you mean -ngl?)"),
])
def test_a_misspelled_option_or_command_is_named_with_the_closest(args, line):
    """Before anything else is made of the arguments (0.5 is not taken as the prompt, the
    required --text is not what is reported): one line, argparse's exit code 2."""
    p = run_tinyrt(*args)
    assert assert_refused(p) == f"tinyrt: error: {line}" and p.returncode == 2


def test_model_is_given_as_the_first_argument_or_with_m(tiny_dir):
    """`generate MODEL PROMPT` as `generate -m MODEL PROMPT`, options anywhere among them;
    two models are refused."""
    opts = ("-n", "4", "--ignore-eos", "--temperature", "0", "--json")
    texts = set()
    for args in (("-m", str(tiny_dir), "hi", *opts), (str(tiny_dir), "hi", *opts),
                 (str(tiny_dir), *opts, "hi")):
        p = run_tinyrt("generate", *args)
        assert p.returncode == 0, p.stderr
        texts.add(json.loads(p.stdout)["text"])
    assert len(texts) == 1
    assert_refused(run_tinyrt("generate", "-m", str(tiny_dir), "other", "hi"), "two models")
    p = run_tinyrt("generate", *opts, "--", str(tiny_dir), "-hi")      # a PROMPT that starts with -
    assert p.returncode == 0 and json.loads(p.stdout)["tokens"] == 4, p.stderr


def test_the_default_sampling_is_the_one_help_states(tiny_dir):
    """Without sampling options: tinyrt's temperature 0.2 and top-p 0.9, llama.cpp's top-k and
    min-p, and the repeat penalty 1.1 (the tiny model has no generation_config.json), as --help
    says."""
    run = ("generate", "-m", str(tiny_dir), "hi", "-n", "12", "--ignore-eos", "--seed", "5",
           "--json")
    default = run_tinyrt(*run)
    stated = run_tinyrt(*run, "--temperature", "0.2", "--top-k", "40", "--top-p", "0.9",
                        "--min-p", "0.05", "--repeat-penalty", "1.1")
    assert default.returncode == 0 and stated.returncode == 0, default.stderr + stated.stderr
    assert json.loads(default.stdout)["text"] == json.loads(stated.stdout)["text"]
    helped = run_tinyrt("generate", "--help").stdout
    for words in ("(default 0.2)", "(default 40)", "(default 0.9)", "(default 0.05)",
                  "(default 1.1 when sampling"):
        assert words in " ".join(helped.split()), words


@pytest.mark.parametrize("args, words", [
    ([b"a\xffb"], ["PROMPT", "UTF-8", "0xff"]),
    (["hi", "--system", b"\xc3("], ["--system", "UTF-8"]),
    (["hi", "--stop", b"\xfe"], ["--stop", "UTF-8"]),
    ([""], ["PROMPT", "empty"]),
])
def test_prompts_that_are_not_text_are_refused(tiny_dir, args, words):
    """Arguments of bytes that are not UTF-8 (Python hands them over surrogate-escaped), and an
    empty prompt: one line naming the argument."""
    assert_refused(run_tinyrt("generate", "-m", str(tiny_dir), *args), *words)


def test_a_prompt_on_stdin_that_is_not_text(tiny_dir):
    p = run_tinyrt("generate", "-m", str(tiny_dir), "-", input=b"caf\xe9 au lait")
    assert_refused(p, "PROMPT", "stdin", "UTF-8", "0xe9")
    p = run_tinyrt("generate", "-m", str(tiny_dir), "-", input=b"")
    assert_refused(p, "PROMPT", "empty")
    p = run_tinyrt("generate", "-m", str(tiny_dir), "-", "-n", "3", input="café".encode())
    assert p.returncode == 0 and p.stdout.strip(), p.stderr


def test_edge_values_that_mean_something_run(tiny_dir, tmp_path):
    """--seed -1 is a random seed (llama.cpp's meaning); a temperature below 1e-5 is greedy;
    a generation_config.json value the sampler cannot use is a warning and the default."""
    run = ("generate", "-m", str(tiny_dir), "hi", "-n", "6", "--ignore-eos", "--json")
    greedy = run_tinyrt(*run, "--temperature", "0")
    assert greedy.returncode == 0, greedy.stderr
    for extra in (["--seed", "-1", "--temperature", "1e-320"], ["--temperature", "4e-6"]):
        p = run_tinyrt(*run, *extra)
        assert p.returncode == 0, p.stderr
        assert json.loads(p.stdout)["text"] == json.loads(greedy.stdout)["text"]
    d = tmp_path / "m"
    shutil.copytree(tiny_dir, d)
    (d / "generation_config.json").write_text('{"top_k": 2.5, "temperature": 0.7}')
    p = run_tinyrt("generate", "-m", str(d), "hi", "-n", "3", "--seed", "1")
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "top_k" in lines[0] and "using the default" in lines[0], lines


# -- a newcomer's habits: ollama's `run`, llama.cpp's spellings, a bare `tinyrt` -------------------

GREEDY = ("-n", "4", "--ignore-eos", "--temperature", "0")


@pytest.mark.parametrize("args, model, prompt", [
    (["run", "M", "--", "-hi"], "M", "-hi"),
    (["run", "M", "--temperature", "0", "--", "-hi"], "M", "-hi"),    # options before "--"
    (["run", "--temperature", "0", "M", "--", "-hi there"], "M", "-hi there"),
    (["generate", "-n", "5", "--", "-hi"], None, "-hi"),
    (["generate", "M", "--", "--json"], "M", "--json"),                # an option's spelling
    (["run", "-m", "M", "--", "-hi"], "M", "-hi"),
    (["run", "What is the capital of France?"], None, "What is the capital of France?"),
    (["run", "smollm2"], "smollm2", None),
    (["run", "-n", "4", "--", "What is it?"], None, "What is it?"),
])
def test_everything_after_a_double_dash_is_positional(args, model, prompt):
    """POSIX's `--`: a PROMPT that starts with a dash, after options or not (parsed here as
    the command parses it, without a model); and `run`'s lone argument is MODEL, as ollama's,
    unless it is text with spaces (a prompt for the default model)."""
    from tinyrt.cli import build_parser, generate

    parsed = build_parser().parse_args(args)
    generate.place_prompt(parsed, lone="model" if args[0] == "run" else "prompt")
    assert (parsed.model or parsed.model_pos, parsed.prompt) == (model, prompt)
    assert build_parser().parse_args(["rm", "-y", "--", "-x", "--all"]).names == ["-x", "--all"]


def test_run_answers_a_prompt_as_generate_and_chats_without_one(tiny_dir):
    """`run MODEL PROMPT` (or -m, -p) is generate's reply; `run MODEL` is the chat (here piped:
    one turn per line, the same replies and notes as `chat`'s); options of either are taken."""
    once = run_tinyrt("generate", str(tiny_dir), "hi", *GREEDY, "--json")
    assert once.returncode == 0, once.stderr
    for args in ((str(tiny_dir), "hi"), ("-m", str(tiny_dir), "hi"), (str(tiny_dir), "-p", "hi"),
                 ("-p", "hi", "-m", str(tiny_dir))):
        p = run_tinyrt("run", *args, *GREEDY, "--json")
        assert p.returncode == 0 and json.loads(p.stdout) == {
            **json.loads(once.stdout), "timings": json.loads(p.stdout)["timings"]}, p.stderr
    chat = run_tinyrt("chat", str(tiny_dir), *GREEDY, "--plain", input="hello\nagain\n")
    assert chat.returncode == 0 and chat.stdout.count("\n") == 2, chat.stderr
    for args in ((str(tiny_dir),), ("-m", str(tiny_dir))):
        p = run_tinyrt("run", *args, *GREEDY, "--plain", input="hello\nagain\n")
        assert p.returncode == 0 and p.stdout == chat.stdout, p.stderr
        assert p.stderr.count("cache ") == chat.stderr.count("cache ") == 2, p.stderr
    assert_refused(run_tinyrt("run", str(tiny_dir), "--json", input=""), "--json", "PROMPT")
    assert_refused(run_tinyrt("run", str(tiny_dir), "a", "-p", "b"), "two prompts")
    assert_refused(run_tinyrt("generate", "-m", str(tiny_dir), "-n", "2"), "no PROMPT")


def test_ollama_s_bye_ends_a_piped_chat(tiny_dir):
    p = run_tinyrt("chat", str(tiny_dir), *GREEDY, input="hi\n/bye\nnever answered\n")
    assert p.returncode == 0 and p.stdout.count("\n") == 1, (p.stdout, p.stderr)


def test_a_piped_chat_goes_on_when_its_cache_fills(tiny_dir):
    """`chat -c 96`, 8 turns of 30 tokens: every turn is answered; that the oldest turns are
    left out is said once, and a reply cut by the cache's end is said to be."""
    turns = "".join(f"turn number {i}\n" for i in range(8))
    p = run_tinyrt("chat", str(tiny_dir), "-c", "96", "-n", "30", "--temperature", "0",
                   "--ignore-eos", input=turns)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert p.stdout.count("\n") == 8 and all(line for line in p.stdout.splitlines()), p.stdout
    assert p.stderr.count("oldest turns are left out") == 1, p.stderr
    assert "room for" not in p.stderr


def test_llama_cpp_spellings_mean_what_they_mean_there(tiny_dir):
    """-p PROMPT; -n/--n-predict N tokens; -c/--ctx-size (and its prefix --ctx) the KV cache's
    size; -ngl taken, with a note of one line on what tinyrt does instead."""
    base = run_tinyrt("generate", str(tiny_dir), "hi", *GREEDY, "--json")
    for args in (("-p", "hi", "-n", "4"), ("hi", "--n-predict", "4"), ("hi", "-n", "4")):
        p = run_tinyrt("generate", str(tiny_dir), *args, "--ignore-eos", "--temperature", "0",
                       "--json")
        assert p.returncode == 0 and json.loads(p.stdout)["text"] == json.loads(base.stdout)["text"]
        assert json.loads(p.stdout)["tokens"] == 4, p.stderr
    for flag in ("-c", "--ctx-size", "--ctx", "--kv-size"):
        assert_refused(run_tinyrt("generate", str(tiny_dir), "hi " * 50, flag, "16"), "prompt has")
    p = run_tinyrt("generate", str(tiny_dir), "hi", *GREEDY, "--json", "-ngl", "99")
    assert p.returncode == 0 and json.loads(p.stdout)["tokens"] == 4, p.stderr
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("note: -ngl") and "--device" in lines[0], lines


def test_a_bare_tinyrt_prints_its_commands():
    """No command: the usage and each command with its line of help, on stderr with argparse's
    exit code 2 (nothing was run), not an error."""
    from tinyrt.cli import COMMANDS

    p = run_tinyrt()
    assert p.returncode == 2 and p.stdout == "" and "error" not in p.stderr, p.stderr
    assert p.stderr.startswith("usage: tinyrt")
    listed = {line.split()[0] for line in p.stderr.split("commands:")[1].splitlines()[1:]
              if line.startswith("  ")}
    assert listed == set(COMMANDS), listed


def test_info_piped_shows_every_value_whole(tmp_path):
    """Where stdout is no terminal (80 columns to a layout), a long path is printed whole."""
    d = write_tiny_model(tmp_path / ("a-directory-with-a-name-long-enough-to-pass-eighty-"
                                     "columns-on-its-own") / "model", tiny_config())
    p = run_tinyrt("info", str(d), env={"COLUMNS": "80"})
    assert p.returncode == 0, p.stderr
    rows = {line.split()[0]: line.split(None, 1)[1] for line in p.stdout.splitlines()
            if line.strip()}
    assert rows["directory"] == str(d) and "--kv-type f16|f32|q8|q4|q2)" in rows["KV"]


def test_converting_a_quantized_gguf_stops_at_once(tmp_path):
    """rtn or awq of a GGUF whose layers are 4-bit: one line with the reason and the command that
    runs the file, nothing written; --requantize converts it."""
    from gguf_helpers import write_gguf
    from helpers import byte_level_tokenizer, random_weights

    cfg = tiny_config()
    src = tmp_path / "m.Q4_0.gguf"
    write_gguf(src, cfg, random_weights(cfg), byte_level_tokenizer(cfg["vocab_size"]).to_str(),
               qtype="Q4_0")
    for method in ((), ("--method", "rtn")):
        p = run_tinyrt("convert", str(src), str(tmp_path / "out"), *method)
        assert_refused(p, "Q4_0", f"tinyrt chat -m {src}", "--requantize")
        assert [x.name for x in tmp_path.iterdir()] == [src.name]
    p = run_tinyrt("convert", str(src), str(tmp_path / "out"), "--method", "rtn",
                   "--group-size", "32", "--requantize")
    assert p.returncode == 0 and (tmp_path / "out" / "config.json").is_file(), p.stderr


def test_info_says_which_sampling_defaults_apply_and_where_from(tmp_path):
    """A model's own settings (its generation_config.json) are named as its; the others are
    tinyrt's, with their values."""
    d = write_tiny_model(tmp_path / "m", tiny_config())
    p = run_tinyrt("info", str(d))
    assert p.returncode == 0, p.stderr
    rows = {line.split()[0]: line.split(None, 1)[1] for line in p.stdout.splitlines()
            if line.strip()}
    assert rows["sampling"] == ("temperature 0.2, top_k 40, top_p 0.9, min_p 0.05, "
                                "repeat_penalty 1.1 (tinyrt's defaults)")
    (d / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_k": 20}))
    rows = {line.split()[0]: line.split(None, 1)[1]
            for line in run_tinyrt("info", str(d)).stdout.splitlines() if line.strip()}
    assert rows["sampling"] == ("temperature 0.6, top_k 20 (generation_config.json); top_p 0.9, "
                                "min_p 0.05, repeat_penalty 1.1 (tinyrt's defaults)")
