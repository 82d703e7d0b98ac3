"""`edgekv serve` through the official openai client: one server per module on 127.0.0.1 (a
free port, in a thread of this process); each answer is checked against the library's own solo
run of the same request (a reference LLM without the prompt cache, so every reference is cold).
The command itself (start, SIGINT / SIGTERM with requests in flight, the missing extra) runs
as a subprocess."""
import asyncio
import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

openai = pytest.importorskip("openai")

from conftest import model_path, serve_process  # noqa: E402
from edgekv import LLM  # noqa: E402
from edgekv.server import Service, listen, uvicorn_server  # noqa: E402

KEY = "test-key"
CTX = 512


@pytest.fixture(scope="module")
def ref():
    return LLM(model_path("smollm2"), n_ctx=CTX, kv="f16", prompt_cache=False)


@pytest.fixture(scope="module")
def server():
    llm = LLM(model_path("smollm2"), n_ctx=CTX, kv="f16")
    records = []
    svc = Service(llm, model_id="smollm2", aliases={llm.path.name}, parallel=8, api_key=KEY, log=records.append,
                  local_only=True)
    sock = listen("127.0.0.1", 0)
    srv = uvicorn_server(svc)
    thread = threading.Thread(target=srv.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    end = time.time() + 30
    while not srv.started:
        assert time.time() < end and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    svc.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    svc.records = records
    yield svc
    srv.handle_exit(signal.SIGINT, None)
    thread.join(30)
    assert not thread.is_alive()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


def _idle(server, timeout=10.0) -> dict:
    """/health once no sequence runs (a request that has answered may still be finishing)."""
    end = time.time() + timeout
    while True:
        h = httpx.get(server.url + "/health").json()
        if h["active_sequences"] == 0 and h["slots_idle"] == h["slots_total"] or time.time() > end:
            return h
        time.sleep(0.02)


def _solo(ref, prompt, **kw):
    """The library's own run: (text, finish_reason, events)."""
    events = list(ref.generate(prompt, **kw))
    return "".join(e.text for e in events), events[-1].finish_reason, events


CHAT = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Name a colour."}]


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list()] == ["smollm2"]
    h = httpx.get(server.url + "/health").json()  # open without the key: a probe for process managers
    assert h["status"] == "ok" and h["model"] == "smollm2" and h["slots_total"] == 8


def test_chat_stream_and_not_match_the_library(server, client, ref):
    ids, _ = ref.chat_prompt(CHAT)
    want, reason, _ = _solo(ref, ids, max_tokens=10, temperature=0)
    r = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=10, temperature=0)
    c = r.choices[0]
    assert (c.message.role, c.message.content, c.finish_reason) == ("assistant", want, reason)
    assert r.object == "chat.completion" and r.model == "smollm2"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens <= 10
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    chunks = list(client.chat.completions.create(model=ref.path.name, messages=CHAT, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert all(ch.usage is None for ch in chunks[:-1])


def test_completion_stream_and_not_match_the_library(client, ref):
    prompt = "The capital of France is"
    want, reason, events = _solo(ref, prompt, max_tokens=8, temperature=0)
    r = client.completions.create(model="smollm2", prompt=prompt, max_tokens=8, temperature=0)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want, reason)
    assert r.usage.prompt_tokens == len(ref.tokenize(prompt)) and r.usage.completion_tokens == len(events) - 1
    chunks = list(client.completions.create(model="smollm2", prompt=prompt, max_tokens=8, temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == want and chunks[-1].choices[0].finish_reason == reason
    ids = ref.tokenize("Once upon a time")  # a prompt of token ids
    r = client.completions.create(model="smollm2", prompt=ids, max_tokens=5, temperature=0)
    assert r.choices[0].text == _solo(ref, ids, max_tokens=5, temperature=0)[0]


def test_n2_each_choice_is_its_seeded_solo_run(client, ref):
    prompt = "My favourite animal is"
    r = client.completions.create(model="smollm2", prompt=prompt, max_tokens=8, temperature=1.0, seed=11, n=2)
    assert [c.index for c in r.choices] == [0, 1]
    for j, c in enumerate(r.choices):  # choice j draws with seed + j
        assert c.text == _solo(ref, prompt, max_tokens=8, temperature=1.0, seed=11 + j)[0]
    assert r.usage.prompt_tokens == len(ref.tokenize(prompt))  # the prompt counted once
    chunks = list(client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=6, temperature=0, n=2,
                                                 stream=True))
    texts = ["".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices[0].index == i) for i in (0, 1)]
    assert texts[0] == texts[1] == _solo(ref, ref.chat_prompt(CHAT)[0], max_tokens=6, temperature=0)[0]


def test_logprobs_are_the_librarys(client, ref):
    ids, _ = ref.chat_prompt(CHAT)
    _, _, events = _solo(ref, ids, max_tokens=6, temperature=0, logprobs=3)
    events = [e for e in events if e.token is not None]
    r = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == len(events)
    for got, e in zip(content, events):
        assert bytes(got.bytes) == ref.tokenizer.token_bytes(e.token)
        assert abs(got.logprob - e.logprob) < 1e-4
        assert [bytes(t.bytes) for t in got.top_logprobs] == [ref.tokenizer.token_bytes(t) for t, _ in e.top_logprobs]
    assert b"".join(bytes(t.bytes) for t in content).decode() == r.choices[0].message.content
    chunks = list(client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=6, temperature=0,
                                                 logprobs=True, top_logprobs=3, stream=True))
    streamed = [t for ch in chunks if ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert [(t.bytes, t.logprob, len(t.top_logprobs)) for t in streamed] == \
        [(t.bytes, t.logprob, len(t.top_logprobs)) for t in content]
    prompt = "The capital of France is"
    _, _, events = _solo(ref, prompt, max_tokens=4, temperature=0, logprobs=2)
    r = client.completions.create(model="smollm2", prompt=prompt, max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text and len(lp.top_logprobs[0]) == 2
    assert all(abs(a - e.logprob) < 1e-4 for a, e in zip(lp.token_logprobs, events))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    chunks = list(client.completions.create(model="smollm2", prompt=prompt, max_tokens=4, temperature=0, logprobs=2,
                                            stream=True))
    parts = [ch.choices[0].logprobs for ch in chunks if ch.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == lp.tokens
    assert [o for p in parts for o in p.text_offset] == lp.text_offset


def test_stop_strings(client, ref):
    prompt = "Once upon a time"
    full = _solo(ref, prompt, max_tokens=16, temperature=0)[0]
    stop = full[len(full) // 2 : len(full) // 2 + 3]  # a piece from the middle of the reference text
    assert stop.strip(), full
    r = client.completions.create(model="smollm2", prompt=prompt, max_tokens=16, temperature=0, stop=[stop, "@@@"])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (full[: full.index(stop)], "stop")
    chunks = list(client.completions.create(model="smollm2", prompt=prompt, max_tokens=16, temperature=0, stop=stop,
                                            stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == full[: full.index(stop)]


def test_second_turn_prefills_only_new_tokens(client):
    first = [{"role": "user", "content": "Here is a list of fruit for a shop window display: apples, pears, plums, "
              "cherries, peaches, apricots, lemons, limes, oranges and figs. Which one is yellow?"}]
    a = client.chat.completions.create(model="smollm2", messages=first, max_tokens=8, temperature=0)
    assert a.usage.prompt_tokens_details.cached_tokens == 0  # nothing of it computed before
    second = first + [{"role": "assistant", "content": a.choices[0].message.content},
                      {"role": "user", "content": "And which one is red?"}]
    b = client.chat.completions.create(model="smollm2", messages=second, max_tokens=8, temperature=0)
    cached = b.usage.prompt_tokens_details.cached_tokens
    assert a.usage.prompt_tokens <= cached < b.usage.prompt_tokens, (a.usage, b.usage)


def test_eight_concurrent_streams_each_equal_its_solo_run(server, client, ref):
    prompts = ["The sea is", "In 1905, Einstein", "A good breakfast has", "Rain falls when", "My cat likes",
               "Python lists are", "The tallest mountain", "Bread is made from"]
    want = [_solo(ref, p, max_tokens=12, temperature=0)[0] for p in prompts]
    got, peak, done = [None] * 8, [0], threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], server.sequences)
            time.sleep(0.002)

    def one(i):
        got[i] = "".join(ch.choices[0].text for ch in client.completions.create(
            model="smollm2", prompt=prompts[i], max_tokens=12, temperature=0, stream=True))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)] + [threading.Thread(target=watch)]
    for t in threads:
        t.start()
    for t in threads[:8]:
        t.join(120)
    done.set()
    threads[8].join()
    assert got == want
    assert peak[0] >= 4  # they ran at once (the engine batches their decode steps)


def test_a_client_that_disconnects_frees_its_sequence(server, client):
    before = server.counts["requests_cancelled"]
    stream = client.completions.create(model="smollm2", prompt="Write a long story about a dragon.", max_tokens=400,
                                       temperature=0, stream=True, extra_body={"logit_bias": {"2": -100}})
    it = iter(stream)
    next(it), next(it)
    assert httpx.get(server.url + "/health").json()["active_sequences"] == 1
    stream.close()
    t0 = time.time()
    h = _idle(server)
    assert h["active_sequences"] == 0 and h["slots_idle"] == 8, h
    assert time.time() - t0 < 5
    rec = server.records[-1]
    assert rec["outcome"] == "cancelled" and rec["completion_tokens"] < 400, rec
    assert server.counts["requests_cancelled"] == before + 1


def test_requests_past_parallel_wait_their_turn(server, client, ref):
    big = client.completions.create(model="smollm2", prompt="List the days of the week.", max_tokens=300, n=8,
                                    temperature=0, stream=True, extra_body={"logit_bias": {"2": -100}})
    it = iter(big)
    next(it)
    assert httpx.get(server.url + "/health").json()["slots_idle"] == 0
    got = []
    small = threading.Thread(target=lambda: got.append(client.completions.create(
        model="smollm2", prompt="Two plus two is", max_tokens=4, temperature=0).choices[0].text))
    small.start()
    end = time.time() + 30
    while httpx.get(server.url + "/health").json()["waiting_requests"] != 1:
        assert time.time() < end and small.is_alive()
        time.sleep(0.01)
    assert not got  # it waits while all 8 sequences are taken
    big.close()  # they are freed; the waiting request runs
    small.join(60)
    assert got == [_solo(ref, "Two plus two is", max_tokens=4, temperature=0)[0]]
    assert _idle(server)["slots_idle"] == 8


def test_slots_are_first_come_first_served():
    from edgekv.server import Slots

    async def main():
        s, order = Slots(2), []
        await s.acquire(1)

        async def want(k, tag):
            await s.acquire(k)
            order.append(tag)

        a = asyncio.ensure_future(want(2, "a"))
        b = asyncio.ensure_future(want(1, "b"))  # one is free, but a came first
        await asyncio.sleep(0.01)
        assert order == [] and len(s.waiting) == 2
        a.cancel()  # a's client left: b goes next
        await asyncio.sleep(0.01)
        assert order == ["b"] and s.free == 0 and not s.waiting
        c = asyncio.ensure_future(want(2, "c"))
        await asyncio.sleep(0.01)
        s.release(1)
        await asyncio.sleep(0.01)
        assert order == ["b"]  # c needs two
        s.release(1)
        await asyncio.sleep(0.01)
        assert order == ["b", "c"] and s.free == 0
        await c

    asyncio.run(main())


def test_console_lines():
    import io

    from edgekv.server import Console

    out = io.StringIO()
    text = Console("m", "text", out)
    rec = dict(method="POST", path="/v1/completions", status=200, seconds=0.5, n=2, prompt_tokens=7, cached_tokens=3,
               completion_tokens=10, decode_tokens_per_s=20.0, outcome="cancelled")
    text.line(rec)
    text.line(dict(method="POST", path="/v1/completions", status=400, error="n must be an integer >= 1, got 0"))
    line = "POST /v1/completions 200 0.50s n=2 prompt 7 (cached 3) + 10 tokens, 20.0 tok/s [cancelled]"
    assert out.getvalue().splitlines() == [
        line,
        "POST /v1/completions 400: n must be an integer >= 1, got 0"]
    out = io.StringIO()
    Console("m", "json", out).line(rec)
    assert {k: v for k, v in json.loads(out.getvalue()).items() if k != "time"} == rec

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    out = Terminal()
    con = Console("m at http://127.0.0.1:1/v1", "text", out)
    con.service = Service(None, model_id="m", parallel=4)
    con.service.counts.update(requests_ok=3, requests_refused=1, tokens_generated=50)
    con.tick()
    status = "[m at http://127.0.0.1:1/v1] requests 4 done, 0 running, 0 waiting | sequences 0/4 | 0.0 tok/s"
    assert out.getvalue() == "\r\033[K" + status
    con.line(rec)  # a request's line goes above the status line, which is drawn again
    assert out.getvalue().endswith("\r\033[K" + line + "\n" + status)


def _status(exc_info) -> tuple[int, dict]:
    e = exc_info.value
    return e.status_code, e.body


BAD_CHAT = [
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]), 400, "tools"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:x"}}]}]), 400,
     "messages[0]"),
    (dict(messages=[{"role": "tool", "content": "x", "tool_call_id": "1"}]), 400, "messages[0]"),
    (dict(messages=[]), 400, "messages"),
    (dict(messages=[{"role": "user", "content": 5}]), 400, "messages[0]"),
    (dict(max_tokens=CTX), 400, "messages"),  # past the context
    (dict(max_tokens=-1), 400, "max_tokens"),
    (dict(temperature="hot"), 400, "temperature"),
    (dict(temperature=5), 400, "temperature"),
    (dict(n=9), 400, "n"),  # more sequences than --parallel 8
    (dict(logit_bias={"999999": 1}), 400, "logit_bias"),
    (dict(top_logprobs=3), 400, "top_logprobs"),  # without logprobs: true
    (dict(stop=[1, 2]), 400, "stop"),
    (dict(response_format={"type": "json_object"}), 400, "response_format"),
    (dict(model="gpt-4o"), 404, "model"),
]


@pytest.mark.parametrize("change,status,param", BAD_CHAT, ids=[f"{i}-{p}" for i, (_, _, p) in enumerate(BAD_CHAT)])
def test_bad_chat_requests_get_openai_errors(server, client, change, status, param):
    kw = {**dict(model="smollm2", messages=CHAT, max_tokens=4), **change}
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(**kw)
    code, body = _status(e)
    assert code == status and body["param"] == param and body["message"] and body["type"], body
    if status == 404:
        assert body["code"] == "model_not_found"


def test_prompt_longer_than_the_context_is_refused(server, client):
    long = "word " * (CTX + 10)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smollm2", prompt=long, max_tokens=1)
    assert e.value.body["code"] == "context_length_exceeded"
    t0 = time.time()
    for call in (lambda: client.completions.create(model="smollm2", prompt="ab " * 2**19, max_tokens=1),
                 lambda: client.chat.completions.create(model="smollm2", max_tokens=1,
                                                        messages=[{"role": "user", "content": "ab " * 2**19}])):
        with pytest.raises(openai.BadRequestError) as e:  # 1.5 MB of text: refused before it is tokenized
            call()
        assert e.value.body["code"] == "context_length_exceeded"
    assert time.time() - t0 < 5
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smollm2", prompt="Hi", max_tokens=1, echo=True)
    assert e.value.body["code"] == "unsupported_parameter"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="smollm2", prompt=[[1, 2], [10**9]], max_tokens=1)
    assert _idle(server)["active_sequences"] == 0


def test_malformed_bodies_get_openai_errors(server):
    h = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
    url = server.url + "/v1/chat/completions"
    cases = [(b"{not json", 400), (b"[1, 2]", 400), (b"\xff\xfe", 400), (b"[" * 100000 + b"]" * 100000, 400),
             (json.dumps({"messages": "hi"}).encode(), 400), (b"x" * (5 * 2**20), 413)]
    for body, status in cases:
        r = httpx.post(url, content=body, headers=h, timeout=60)
        assert r.status_code == status, (body[:20], r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
    r = httpx.get(server.url + "/v1/nowhere", headers=h)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.get(url, headers=h)
    assert r.status_code == 405 and "error" in r.json()
    r = httpx.post(url, content=json.dumps({"messages": CHAT, "max_tokens": 2, "some_future_field": {"a": 1}}),
                   headers=h)
    assert r.status_code == 200, r.text  # unknown fields are ignored
    h = _idle(server)
    assert h["active_sequences"] == 0 and h["slots_idle"] == 8


def test_web_pages_cannot_use_it(server):
    h = {"authorization": f"Bearer {KEY}"}
    body = json.dumps({"prompt": "Hi", "max_tokens": 1})
    # what a page can send anywhere without asking (a "simple" cross-site request): refused
    r = httpx.post(server.url + "/v1/completions", content=body, headers=dict(h, **{"content-type": "text/plain"}))
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    # a site's name that resolves to 127.0.0.1 (DNS rebinding): refused; this machine's names are not
    for host, status in (("evil.example", 403), ("evil.example:80", 403), ("localhost:1234", 200),
                         ("127.0.0.1", 200), ("[::1]:8080", 200)):
        r = httpx.post(server.url + "/v1/completions", content=body,
                       headers=dict(h, **{"content-type": "application/json", "host": host}))
        assert r.status_code == status, (host, r.text)


def test_api_key(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0) as c:
        for call in (c.models.list, lambda: c.completions.create(model="smollm2", prompt="Hi", max_tokens=1)):
            with pytest.raises(openai.AuthenticationError) as e:
                call()
            assert e.value.body["code"] == "invalid_api_key"
    for headers in ({}, {"authorization": KEY}, {"authorization": f"Basic {KEY}"}):  # no key, or not as Bearer
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi"}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


# --- the command ------------------------------------------------------------------------------

@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_the_command_shuts_down_cleanly_with_requests_in_flight(sig):
    p, start = serve_process("--parallel", "2")
    try:
        assert start["event"] == "listening" and start["url"].startswith("http://127.0.0.1:")
        c = openai.OpenAI(base_url=start["url"], api_key="none", max_retries=0, timeout=60)
        got, errors, started = [[], []], [None, None], [threading.Event(), threading.Event()]

        def one(i):
            try:
                for ch in c.completions.create(model=start["model"], prompt=f"Story number {i}:",
                                               max_tokens=200, temperature=0, stream=True,
                                               extra_body={"logit_bias": {"2": -100}}):
                    got[i].append(ch.choices[0].text)
                    started[i].set()
            except openai.APIError as e:
                errors[i] = e
            started[i].set()

        threads = [threading.Thread(target=one, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()
        assert all(s.wait(60) for s in started)
        p.send_signal(sig)
        for t in threads:
            t.join(30)
        assert p.wait(30) == 0
    finally:
        if p.poll() is None:
            p.kill()
    out, err = p.stdout.read(), p.stderr.read()
    assert "Traceback" not in err and "ERROR" not in err, err
    records = [json.loads(x) for x in out.splitlines()]
    assert records[-1]["event"] == "stopped"
    assert [r["outcome"] for r in records if "outcome" in r] == ["shutdown", "shutdown"]
    for i in (0, 1):  # each stream had begun, then was told the server stops
        assert got[i] and errors[i] is not None and "shutting down" in str(errors[i])


def test_the_command_without_the_server_extra_says_what_to_install():
    code = ("import sys; sys.modules['uvicorn'] = None; from edgekv.cli import main; "
            f"sys.exit(main(['serve', {str(model_path('smollm2'))!r}]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.strip().splitlines() == ['edgekv: error: edgekv serve needs the server extra (uvicorn is not '
                                             'installed): pip install "edgekv[server]"']


def test_an_address_that_cannot_be_had_is_one_error():
    import socket

    from edgekv import EdgekvError

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(EdgekvError, match=f"cannot listen on 127.0.0.1:{port}: Address already in use"):
            listen("127.0.0.1", port)
    with pytest.raises(EdgekvError, match="cannot listen on 256.1.1.1:80"):
        listen("256.1.1.1", 80)


def test_another_host_without_a_key_warns(capsys):
    from edgekv.cli import exposed

    assert exposed("127.0.0.1", None) is None and exposed("localhost", None) is None and exposed("::1", None) is None
    assert exposed("0.0.0.0", "k") is None
    assert "--api-key" in exposed("0.0.0.0", None) and "--api-key" in exposed("my-laptop.local", None)
