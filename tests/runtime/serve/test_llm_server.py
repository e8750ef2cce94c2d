"""`kiln serve` for a language model, against a live server with the official openai client: chat and
completions, stream or not, stop strings and token ids, concurrent streams equal to the same request alone,
every bad request answered as OpenAI answers it, a full queue, a client that goes away, metrics."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from kiln.runtime.serve.engine_process import EngineProcess
from tests.runtime.serve.conftest import client, live_server, openai
from tests.runtime.tiny_llm import words

MODEL = "tiny"


@pytest.fixture(scope="module", params=["thread", "process"])
def server(llm_path, request):
    """The engine on a thread of the server's process, and in a process of its own (what `kiln serve` runs)."""
    with live_server(llm_path, engine_process=request.param == "process") as s:
        yield s


def chat(c, content, **options):
    """Greedy unless told otherwise; the random model's stop tokens ignored (vLLM's ignore_eos) so that lengths
    are what the test asks for."""
    options.setdefault("temperature", 0)
    options["extra_body"] = {"ignore_eos": True, **options.get("extra_body", {})}
    return c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **options)


def streamed_text(stream) -> tuple[str, str | None, object]:
    text, reason, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text.append(getattr(choice, "delta", None) and choice.delta.content or getattr(choice, "text", "") or "")
            reason = choice.finish_reason or reason
    return "".join(text), reason, usage


def post(server, path: str, data: bytes, content_type: str = "application/json", method: str = "POST"):
    """(status, headers, body) of a raw request (for what the openai client would refuse to send)."""
    request = urllib.request.Request(f"http://127.0.0.1:{server.port}{path}", data=data, method=method,
                                     headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def test_chat_stream_and_not_agree(server):
    c = client(server)
    whole = chat(c, words(5, 6, 7), max_tokens=10)
    assert whole.object == "chat.completion" and whole.model == MODEL
    assert whole.choices[0].finish_reason == "length" and whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens == 10 and whole.usage.total_tokens == whole.usage.prompt_tokens + 10
    text, reason, usage = streamed_text(chat(c, words(5, 6, 7), max_tokens=10, stream=True,
                                             stream_options={"include_usage": True}))
    assert text == whole.choices[0].message.content and reason == "length"
    assert usage.prompt_tokens == whole.usage.prompt_tokens and usage.completion_tokens == 10


def test_completions_stream_and_not_agree(server):
    c = client(server)
    whole = c.completions.create(model=MODEL, prompt=words(9, 10), max_tokens=6, temperature=0,
                                 extra_body={"ignore_eos": True})
    assert whole.object == "text_completion" and whole.choices[0].finish_reason == "length"
    text, reason, _ = streamed_text(c.completions.create(model=MODEL, prompt=words(9, 10), max_tokens=6,
                                                         temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert text == whole.choices[0].text and reason == "length"
    ids = c.completions.create(model=MODEL, prompt=[1, 17, 18], max_tokens=6, temperature=0)
    assert ids.usage.prompt_tokens == 3


def test_stop_strings_and_stop_token_ids_end_with_reason_stop(server):
    c = client(server)
    full = chat(c, words(5, 6, 7), max_tokens=10).choices[0].message.content
    pieces = full.split(" ")
    stopped = chat(c, words(5, 6, 7), max_tokens=10, stop=[" " + pieces[3]])
    assert stopped.choices[0].message.content == " ".join(pieces[:3]) and stopped.choices[0].finish_reason == "stop"
    text, reason, _ = streamed_text(chat(c, words(5, 6, 7), max_tokens=10, stop=[pieces[2][:2] + "zzz", pieces[2]],
                                         stream=True))
    assert text == " ".join(pieces[:2]) + " " and reason == "stop"
    token = int(pieces[4][1:]) + 8  # w_i is token id i + 8
    by_id = chat(c, words(5, 6, 7), max_tokens=10, extra_body={"stop_token_ids": [token]})
    assert by_id.choices[0].message.content.split(" ") == pieces[:4] and by_id.choices[0].finish_reason == "stop"


def test_sampling_with_a_seed_repeats(server):
    c = client(server)
    runs = [chat(c, words(3, 4), max_tokens=8, temperature=1.3, top_p=0.9, seed=7).choices[0].message.content
            for _ in range(2)]
    assert runs[0] == runs[1]


def test_concurrent_streams_each_get_what_they_get_alone(server):
    """16 greedy streams over 4 slots (the rest queued, joining as slots free up) each return exactly what the
    same request returns alone."""
    c = client(server)
    prompts = [words(k, k + 1, 2 * k % 50) for k in range(16)]
    alone = [chat(c, p, max_tokens=12 + k % 5).choices[0].message.content for k, p in enumerate(prompts)]

    # The clients exist before the threads start and the threads send at one moment: a client built inside its
    # thread took longer on a loaded 2-core CI machine than a whole tiny-model generation, so the streams ran one
    # after another and no step batched two of them.
    clients = [client(server) for _ in prompts]
    start = threading.Barrier(len(prompts))

    def run(k: int) -> str:
        start.wait(timeout=60)
        return streamed_text(chat(clients[k], prompts[k], max_tokens=12 + k % 5, stream=True))[0]

    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(run, range(16), timeout=120))
    assert together == alone
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=30).read().decode()
    batches = [line for line in metrics.splitlines() if line.startswith("kiln_decode_batch_size_bucket")]
    assert batches and 'le="1.0"' in batches[0]
    single = int(batches[0].rsplit(" ", 1)[1])
    total = int(next(ln for ln in metrics.splitlines() if ln.startswith("kiln_decode_batch_size_count")).split()[-1])
    print("HIST", single, total, batches)
    assert total > single, "no decode step ran more than one sequence"


BAD_REQUESTS = [
    # (body, param or None, status)
    (b"{not json", None, 400),
    (b"[1, 2]", None, 400),
    (json.dumps({"model": MODEL}).encode(), "messages", 400),
    (json.dumps({"model": MODEL, "messages": []}).encode(), "messages", 400),
    (json.dumps({"model": MODEL, "messages": "hi"}).encode(), "messages", 400),
    (json.dumps({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}).encode(), "messages[0].role", 400),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": 3}]}).encode(), "messages[0].content", 400),
    (json.dumps({"messages": [{"role": "user", "content": "w1"}]}).encode(), "model", 400),
    (json.dumps({"model": "gpt-9", "messages": [{"role": "user", "content": "w1"}]}).encode(), "model", 400),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "w1"}], "temperature": "hot"}).encode(),
     "temperature", 400),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "w1"}], "temperature": 3}).encode(),
     "temperature", 400),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "w1"}], "max_tokens": 0}).encode(),
     "max_tokens", 400),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "w1"}], "max_tokens": 1000}).encode(),
     "max_tokens", 400),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": words(*range(70))}]}).encode(),
     "messages", 400),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "w1"}], "n": 2}).encode(), "n", 400),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "w1"}], "stop": [1]}).encode(), "stop",
     400),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "w1"}], "stream": "yes"}).encode(),
     "stream", 400),
]


@pytest.mark.parametrize("body,param,status", BAD_REQUESTS, ids=range(len(BAD_REQUESTS)))
def test_bad_chat_requests_are_answered_as_openai_does(server, body, param, status):
    code, headers, raw = post(server, "/v1/chat/completions", body)
    assert code == status and headers["content-type"].startswith("application/json")
    error = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_bad_completion_requests_and_routes(server):
    for body, param in (({"model": MODEL}, "prompt"), ({"model": MODEL, "prompt": [1, 999]}, "prompt"),
                        ({"model": MODEL, "prompt": ""}, "prompt"),
                        ({"model": MODEL, "prompt": "w1", "max_tokens": 64}, "max_tokens"),
                        ({"model": MODEL, "prompt": "w1", "echo": True}, "echo")):
        code, _, raw = post(server, "/v1/completions", json.dumps(body).encode())
        assert code == 400 and json.loads(raw)["error"]["param"] == param, raw
    code, _, raw = post(server, "/v1/nothing", b"{}")
    assert code == 404 and json.loads(raw)["error"]["type"] == "not_found_error"
    code, _, raw = post(server, "/v1/chat/completions", None, method="GET")
    assert code == 405 and "error" in json.loads(raw)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        chat(client(server), words(*range(70)))
    assert chat(client(server), words(1), max_tokens=2).choices[0].finish_reason == "length"  # still serving


def test_health_models_and_metrics(server):
    assert json.loads(urllib.request.urlopen(f"http://127.0.0.1:{server.port}/health").read())["status"] == "ok"
    (card,) = client(server).models.list().data
    assert card.id == MODEL and card.owned_by == "kiln"
    chat(client(server), words(2), max_tokens=3)
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics").read().decode()
    for series in ("kiln_requests_total", "kiln_prompt_tokens_total", "kiln_generation_tokens_total",
                   "kiln_queue_depth", "kiln_running_sequences", "kiln_time_to_first_token_seconds_bucket",
                   "kiln_inter_token_latency_seconds_count", "kiln_decode_batch_size_sum"):
        assert f"\n{series}" in text, series
    assert '# TYPE kiln_requests_total counter' in text
    cpu = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
           if line.startswith(("kiln_http_process_cpu_seconds_total", "kiln_engine_process_cpu_seconds_total"))}
    assert "# TYPE kiln_http_process_cpu_seconds_total counter" in text
    assert cpu["kiln_http_process_cpu_seconds_total"] > 0
    # the engine's own process reports its CPU time with its events; on a thread it is the server's process
    in_process = isinstance(server.app.state.service.engine, EngineProcess)
    assert ("kiln_engine_process_cpu_seconds_total" in cpu) == in_process
    assert cpu.get("kiln_engine_process_cpu_seconds_total", 1.0) > 0


class Gate:
    """Makes the engine's session wait at each run until released (so requests queue up deterministically), or
    slows each run down."""

    def __init__(self, session, delay: float = 0.0):
        self.session, self.run, self.delay = session, session.run, delay
        self.open = threading.Event()
        session.run = self.gated

    def gated(self, *args, **kwargs):
        self.open.wait(60)
        time.sleep(self.delay)
        return self.run(*args, **kwargs)

    def restore(self):
        self.open.set()
        self.session.run = self.run


def test_a_full_queue_answers_503_with_retry_after(tmp_path):
    from tests.runtime.tiny_llm import export_tiny_llm

    path = export_tiny_llm()[1].save(tmp_path / "one.kiln")  # no slots: one sequence at a time
    with live_server(path, max_queue=1) as server:
        gate = Gate(server.app.state.service.engine.session)
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(chat, client(server), words(1, 2), max_tokens=3)  # takes the slot, held
            deadline = time.monotonic() + 30
            while server.app.state.service.engine.running == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            second = pool.submit(chat, client(server), words(3), max_tokens=3)  # waits in the queue
            while server.app.state.service.engine.queue_depth == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            code, headers, raw = post(server, "/v1/chat/completions", json.dumps(
                {"model": MODEL, "messages": [{"role": "user", "content": "w1"}]}).encode())
            assert code == 503 and headers["Retry-After"] == "1"
            assert json.loads(raw)["error"]["code"] == "queue_full"
            gate.restore()
            assert first.result(60).choices[0].finish_reason == "length"
            assert second.result(60).choices[0].finish_reason == "length"


def test_a_client_that_goes_away_frees_its_slot(llm_path):
    with live_server(llm_path) as server:
        engine = server.app.state.service.engine
        gate = Gate(engine.session, delay=0.02)
        gate.open.set()
        stream = chat(client(server), words(4, 5), max_tokens=50, stream=True)
        next(iter(stream))
        stream.response.close()  # the client hangs up mid-stream
        cancelled = 'kiln_generations_total{finish_reason="cancelled",model="tiny"} 1'
        deadline = time.monotonic() + 10
        text = ""
        # the first chunk can arrive before the engine admits the request: wait for the cancellation itself
        while time.monotonic() < deadline:
            text = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics").read().decode()
            if cancelled in text and not engine.running:
                break
            time.sleep(0.01)
        assert cancelled in text
        assert engine.running == 0 and sorted(engine._free) == [0, 1, 2, 3]
        gate.restore()
        assert chat(client(server), words(4, 5), max_tokens=4).choices[0].finish_reason == "length"
