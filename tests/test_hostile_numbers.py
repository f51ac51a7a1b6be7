"""Numbers too big (or not finite) for what they are used as, from every front end: the command
line's options (one line on stderr, no traceback), chat's /set, the library's keywords, and the
server's fields and headers (an OpenAI error object with status 400, never a 500); and the
server's log when clients vanish mid-request (no traceback for what a client did)."""

import json
import logging
import socket
import time

import openai
import pytest

import tinyrt
from helpers import assert_refused, run_tinyrt, tiny_config, write_tiny_model
from tinyrt.errors import TinyrtError

HUGE = "1" + "0" * 400           # past a float's range: int -> float overflows
VAST = "1" + "0" * 5000          # past the 4,300 digits Python converts between int and str
SHORT = 300                      # an error line shows a value cut short, not thousands of digits


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("numbers") / "m", tiny_config(), seed=3)


def refused(*args, words=(), input=None) -> str:
    line = assert_refused(run_tinyrt(*args, input=input), *words)
    assert len(line) < SHORT, line
    return line


# -- the command line ------------------------------------------------------------------------------

def test_generation_flags_refuse_numbers_past_a_float(tiny):
    """--seed, --top-k, -n with hundreds of digits (an OverflowError where the check made a
    float of them), and floats that are not finite, each named by its flag."""
    for flag, value in [("--seed", HUGE), ("--top-k", HUGE), ("-n", HUGE), ("--max-tokens", "-" + HUGE),
                        ("--temperature", "1e400"), ("--top-p", "nan"), ("--min-p", "inf"),
                        ("--repeat-penalty", "-" + HUGE)]:
        name = "--max-tokens" if flag == "-n" else flag
        refused("generate", "-m", str(tiny), "hi", flag, value, words=[name])


def test_an_integer_past_python_s_digits_is_not_shown_as_inf(tiny):
    """int() refuses 5,001 digits; float() took them as inf, and the message named a value the
    user did not give."""
    line = refused("generate", "-m", str(tiny), "hi", "--seed", VAST, words=["--seed"])
    assert "inf" not in line, line


def test_sizes_refuse_numbers_past_a_float(tiny, tmp_path):
    refused("generate", "-m", str(tiny), "hi", "--kv-mem", HUGE + "GB", words=["--kv-mem"])
    refused("convert", str(tiny), str(tmp_path / "out"), "--method", "none",
            "--max-shard-size", HUGE + "GB", words=["--max-shard-size"])
    assert not (tmp_path / "out").exists()


def test_whole_number_options_refuse_vast_ones_in_one_short_line(tiny, tmp_path):
    """argparse's own refusal wrote all 5,001 digits back; every command's whole-number options
    take the same parse."""
    m = str(tiny)
    for args, flag in [(("generate", "-m", m, "hi", "--kv-size"), "--kv-size"),
                       (("generate", "-m", m, "hi", "--threads"), "--threads"),
                       (("ppl", "-m", m, "--text", m + "/config.json", "--ctx"), "--ctx"),
                       (("serve", "-m", m, "--port"), "--port"),
                       (("convert", m, str(tmp_path / "o"), "--calib-seqlen"), "--calib-seqlen")]:
        refused(*args, VAST, words=[flag])
    refused("generate", "-m", m, "hi", "--kv-size", "1.5", words=["--kv-size", "whole number"])


def test_convert_checks_its_numbers_before_any_work(tiny, tmp_path):
    """--calib-seqlen 0 divided by zero, one of hundreds of digits overflowed a float, and a
    negative --seed was NumPy's ValueError, each after the model was read."""
    out = tmp_path / "out"
    for flag, value in [("--calib-seqlen", "0"), ("--calib-seqlen", HUGE), ("--seed", "-1"),
                        ("--seed", HUGE), ("--calib-samples", HUGE), ("--group-size", HUGE)]:
        refused("convert", str(tiny), str(out), flag, value, words=[flag])
        assert not out.exists()


def test_chat_set_refuses_huge_numbers(tiny):
    """/set's values take the options' parse and check: a turn's error note, then chat goes on."""
    p = run_tinyrt("chat", "-m", str(tiny), "--plain",
                   input=f"/set top_k {HUGE}\n/set seed {VAST}\n/set max_tokens 1e400\n")
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    notes = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(notes) == 3, p.stderr
    assert "top_k" in notes[0] and "seed" in notes[1] and "max_tokens" in notes[2]
    assert "inf" not in notes[1] and all(len(n) < SHORT for n in notes), notes


# -- the library -----------------------------------------------------------------------------------

def test_library_keywords_refuse_vast_integers(tiny):
    """The checks' messages wrote the value out, which Python refuses past 4,300 digits (a
    ValueError in place of the TinyrtError)."""
    vast = 10 ** 5000
    for kw in [dict(kv_size=vast), dict(kv_mem=vast), dict(threads=vast), dict(sinks=-vast),
               dict(kv_mem=HUGE + "GB")]:
        with pytest.raises(TinyrtError, match="digits|largest size"):
            tinyrt.load(tiny, device="reference", **kw)
    llm = tinyrt.load(tiny, device="reference", kv_size=64)
    for kw in [dict(seed=vast), dict(seed=10 ** 400), dict(max_tokens=-vast),
               dict(temperature=vast), dict(top_p=10 ** 400)]:
        with pytest.raises(TinyrtError, match=next(iter(kw))):
            llm.generate("hi", **kw)
    from tinyrt.memory import parse_size
    from tinyrt.perplexity import check_options

    with pytest.raises(TinyrtError, match="digits"):
        check_options(max_windows=-vast)
    with pytest.raises(TinyrtError, match="largest size"):
        parse_size("9" * 400)


# -- the server ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def served(tiny):
    from test_server import Running

    run = Running(tinyrt.LLM(tiny, device="reference", kv_size=256, kv_type="f32"))
    yield run
    run.stop()


def raw_post(port: int, body: bytes, path: str = "/v1/chat/completions") -> tuple[int, dict]:
    s = socket.create_connection(("127.0.0.1", port), timeout=60)
    s.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Connection: close\r\nContent-Length: %d\r\n\r\n" % (path.encode(), len(body)) + body)
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    s.close()
    head, _, rest = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(rest)


HI = [{"role": "user", "content": "hi"}]


def test_seed_of_thousands_of_digits_is_a_400_through_the_openai_client(served):
    with pytest.raises(openai.BadRequestError) as e:
        served.client.chat.completions.create(model="tiny", messages=HI, max_tokens=2,
                                              seed=10 ** 4000)
    assert e.value.status_code == 400 and e.value.body["param"] == "seed"
    assert "digits" in e.value.body["message"]


def test_every_numeric_field_refuses_hostile_numbers_with_a_400(served):
    """Integers past a float's range (a 500 where the check made a float of them), past
    Python's 4,300 digits (valid JSON, refused as such), and floats past their range (1e400
    is inf in JSON's reading)."""
    fields = ["max_tokens", "max_completion_tokens", "n", "seed", "temperature", "top_p",
              "top_k", "min_p", "presence_penalty", "frequency_penalty", "repeat_penalty",
              "logprobs", "top_logprobs", "best_of"]
    for field in fields:
        for value in (HUGE, "-" + HUGE, "1e400", "-1e400"):
            body = '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "%s": %s}' \
                % (field, value)
            status, reply = raw_post(served.port, body.encode())
            assert status == 400, (field, value[:10], reply)
            assert reply["error"]["param"] == field, (field, value[:10], reply)
    for body in ['{"messages": [], "seed": %s}' % VAST, '{"prompt": [%s]}' % VAST,
                 '{"prompt": "hi", "logit_bias": {"1": %s}}' % VAST]:
        status, reply = raw_post(served.port, body.encode(), "/v1/completions")
        assert status == 400 and "digits" in reply["error"]["message"], reply
    for body in ['{"prompt": [%s]}' % HUGE, '{"prompt": "hi", "logit_bias": {"%s": 1}}' % VAST,
                 '{"prompt": "hi", "stop": [%s]}' % HUGE]:
        status, reply = raw_post(served.port, body.encode(), "/v1/completions")
        assert status == 400, reply


def asgi_post(app, headers: list, body: bytes) -> int:
    """The app called in-process, as a server hands it a request: the response's status."""
    import asyncio

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "headers": headers,
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    sent, given = [], [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        return given.pop(0) if given else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return sent[0]["status"]


def test_content_length_that_int_refuses_is_not_a_500(served):
    """A header of digits str.isdigit takes and int() does not ('²'; 5,001 digits): HTTP
    servers other than httptools (h11, a test client) hand it over."""
    app = served.server.app()
    for length in ["\u00b2".encode("latin-1"), VAST.encode(), b"12345678901234567890123"]:
        status = asgi_post(app, [(b"content-type", b"application/json"),
                                 (b"content-length", length)], b'{"prompt": ""}')
        assert status in (400, 413), (length[:10], status)


@pytest.fixture
def server_log():
    """What uvicorn logs as errors while a test runs (its `uvicorn.error` logger)."""
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Keep(level=logging.WARNING)
    logger = logging.getLogger("uvicorn.error")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def test_clients_vanishing_mid_body_leave_no_traceback(served, server_log):
    """Each client that closed its connection while it sent its body left a traceback
    (starlette's ClientDisconnect, "Exception in ASGI application"): ~20 from one burst of slow
    clients. Also a malformed chunked body, and a client that leaves mid-stream."""
    heads = [b"Content-Length: 1000\r\n\r\n{\"messages\":",
             b"Transfer-Encoding: chunked\r\n\r\n40\r\n{\"messages\":",
             b"Transfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n"]
    for i in range(6):
        s = socket.create_connection(("127.0.0.1", served.port), timeout=30)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                  b"Content-Type: application/json\r\n" + heads[i % 3])
        time.sleep(0.1)
        s.close()
    body = json.dumps({"messages": HI, "stream": True, "max_tokens": 100,
                       "ignore_eos": True}).encode()
    s = socket.create_connection(("127.0.0.1", served.port), timeout=30)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
              b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    assert s.recv(100).startswith(b"HTTP/1.1 200")
    s.close()
    served.idle()
    deadline = time.monotonic() + 2            # (the disconnects reach the app asynchronously)
    while time.monotonic() < deadline and not any(r.exc_info for r in server_log):
        time.sleep(0.05)
    assert served.client.chat.completions.create(model="tiny", messages=HI, max_tokens=2)
    bad = [r for r in server_log if r.exc_info or "Exception" in r.getMessage()]
    assert not bad, [r.getMessage() for r in bad]
    assert len(server_log) <= 6, [r.getMessage() for r in server_log]   # one line each at most


def test_upgrade_requests_leave_no_lines_in_the_log():
    """uvicorn logs two warnings for every request that asks for a WebSocket upgrade (CONNECT,
    Upgrade: websocket), which any client may send without end; `tinyrt serve` drops those two,
    and keeps its other lines."""
    from tinyrt.cli.serve import _no_upgrade_notes

    def record(msg):
        return logging.LogRecord("uvicorn.error", logging.WARNING, __file__, 1, msg, (), None)

    assert not _no_upgrade_notes(record("Unsupported upgrade request."))
    assert not _no_upgrade_notes(record("No supported WebSocket library detected. Please use"))
    assert _no_upgrade_notes(record("Invalid HTTP request received."))
