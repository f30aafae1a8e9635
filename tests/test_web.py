"""The web page's API (glassgpt.web.app) with FastAPI's TestClient, on a tiny random model.

Every endpoint, every way a request can be wrong (each answered with a JSON message,
never a crash), the page's assets served locally, and concurrency: requests from many
threads each get their own correct trace, and a slow trace does not hold up the page.
"""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
from fastapi.testclient import TestClient  # noqa: E402

import glassgpt  # noqa: E402
from glassgpt.errors import GlassError  # noqa: E402
from glassgpt.web import app as web_app  # noqa: E402
from glassgpt.web import create_app  # noqa: E402
from glassgpt.weights import random_model  # noqa: E402

PROMPT = "Every effort moves you"  # 4 GPT-2 tokens
CFG = glassgpt.GPTConfig(vocab_size=50257, context_length=16, emb_dim=8, n_heads=2, n_layers=2)


@pytest.fixture(scope="module")
def tok():
    return glassgpt.get_tokenizer("gpt2")


@pytest.fixture(scope="module")
def model():
    return random_model(CFG, torch.device("cpu"), torch.float32, seed=0)


@pytest.fixture(scope="module")
def client(model, tok):
    with TestClient(create_app(model, tok, model_name="tiny", random_weights=True)) as c:
        yield c


@pytest.fixture(scope="module")
def classifier(tok):
    cfg = glassgpt.GPTConfig(vocab_size=50257, context_length=16, emb_dim=8, n_heads=2, n_layers=2,
                             tie_embeddings=False, num_classes=2)
    model = random_model(cfg, torch.device("cpu"), torch.float32, seed=1)
    with TestClient(create_app(model, tok, model_name="spam", labels=["ham", "spam"])) as c:
        yield c


def explain(client, **body):
    return client.post("/api/explain", json=body)


def shapes(trace: dict) -> dict[str, list[int]]:
    return {s["name"]: s["shape"] for s in trace["stages"]}


def assert_error(response, status: int, *words: str) -> str:
    assert response.status_code == status, response.text
    message = response.json()["error"]
    assert isinstance(message, str) and message
    for w in words:
        assert w in message, message
    return message


# --- the page ------------------------------------------------------------------------

def test_page_and_its_assets_are_served(client):
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for asset, kind in (("app.js", "text/javascript"), ("style.css", "text/css")):
        assert f"/static/{asset}" in page.text
        r = client.get(f"/static/{asset}")
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind)
    assert "default-src 'self'" in page.headers["content-security-policy"]


def test_page_loads_nothing_from_another_host(client):
    for path in ("/", "/static/app.js", "/static/style.css"):
        text = client.get(path).text
        assert not re.search(r"""(src|href|url)\s*[=(]\s*["']?(https?:)?//""", text), path
        assert "@import" not in text


def test_unknown_asset_is_404_json(client):
    assert_error(client.get("/static/nope.js"), 404, "nope.js")


def test_model_endpoint_describes_the_loaded_model(client, model):
    info = client.get("/api/model").json()
    assert info["name"] == "tiny" and info["random_weights"] is True
    assert info["config"] == CFG.to_dict()
    assert info["params"] == {"total": model.num_parameters(),
                              "total_untied": model.num_parameters(count_tied_twice=True), "tied": True}
    assert info["limits"]["max_prompt_tokens"] == CFG.context_length


# --- /api/explain, /api/append, /api/diagram.svg ---------------------------------------

def test_explain_returns_the_trace_json(client, model, tok):
    got = explain(client, prompt=PROMPT, top_k=5, attention=False, logit_lens=False).json()
    want = glassgpt.trace(model, tok, PROMPT, top_k=5, model_name="tiny", random_weights=True,
                          embedding_check=False).to_dict()
    assert [s["name"] for s in got["stages"]] == [s["name"] for s in want["stages"]]
    assert got["stages"] == want["stages"]
    assert got["tokens"] == want["tokens"] and got["params"] == want["params"]
    assert got["next_token"] == pytest.approx(want["next_token"])
    assert shapes(got)["tok_emb"] == [1, 4, 8] and shapes(got)["out_head"] == [1, 4, 50257]


def test_the_two_transitions_carry_their_weights(client):
    stages = {s["name"]: s for s in explain(client, prompt=PROMPT).json()["stages"]}
    assert stages["tok_emb"]["transition"] == "vocab->hidden" and stages["tok_emb"]["weight_shape"] == [50257, 8]
    head = stages["out_head"]
    assert head["transition"] == "hidden->vocab" and head["shared_with"] == "tok_emb.weight"
    assert head["weight_shape"] == [50257, 8] and head["params"] == 50257 * 8


def test_explain_by_ids_matches_explain_by_text(client, tok):
    by_text = explain(client, prompt=PROMPT).json()
    by_ids = explain(client, ids=tok.encode(PROMPT)).json()
    assert by_ids["tokens"] == by_text["tokens"] and by_ids["prompt"] == PROMPT
    assert by_ids["next_token"] == by_text["next_token"]


def test_append_traces_the_ids_plus_the_token(client, tok):
    ids = tok.encode(PROMPT)
    first = explain(client, ids=ids).json()
    token = first["next_token"]["top"][2]["id"]  # a clicked token, not the greedy one
    after = client.post("/api/append", json={"ids": ids, "token": token}).json()
    assert [t["id"] for t in after["tokens"]] == ids + [token]
    assert after == explain(client, ids=ids + [token]).json()
    assert shapes(after)["out_head"] == [1, 5, 50257]


def test_append_to_a_prompt_given_as_text(client, tok):
    after = client.post("/api/append", json={"prompt": PROMPT, "token": 13}).json()
    assert [t["id"] for t in after["tokens"]] == tok.encode(PROMPT) + [13]


def test_temperature_rescales_the_probabilities(client, model, tok):
    ids = torch.tensor([tok.encode(PROMPT)])
    with torch.inference_mode():
        last = model(ids)[0, -1].float()
    for temperature in (0.5, 1.0, 2.0):
        got = explain(client, prompt=PROMPT, temperature=temperature, top_k=3).json()["next_token"]
        probs = (last / temperature).softmax(-1)
        assert got["temperature"] == temperature
        for t in got["top"]:
            assert t["prob"] == pytest.approx(float(probs[t["id"]]), rel=1e-5)
    cold = explain(client, prompt=PROMPT, temperature=0.5).json()["next_token"]["prob"]
    hot = explain(client, prompt=PROMPT, temperature=2.0).json()["next_token"]["prob"]
    assert cold > hot


@pytest.mark.parametrize("k", [1, 7, 100])
def test_top_k_sets_how_many_tokens_are_listed(client, k):
    top = explain(client, prompt=PROMPT, top_k=k).json()["next_token"]["top"]
    assert len(top) == k
    assert [t["prob"] for t in top] == sorted((t["prob"] for t in top), reverse=True)


def test_attention_and_logit_lens_cover_every_layer(client):
    tr = explain(client, prompt=PROMPT).json()
    att = tr["attention"]
    assert att["shape"] == [2, 1, 2, 4, 4] and len(att["layers"]) == 2 and len(att["layers"][0]) == 2
    for head in att["layers"][1]:
        for i, row in enumerate(head):
            assert sum(row) == pytest.approx(1.0, abs=1e-3)  # rounded to 4 decimals
            assert all(w == 0 for w in row[i + 1:])  # causal
    assert [layer["layer"] for layer in tr["logit_lens"]["layers"]] == [0, 1]
    assert all(len(layer["top"]) == 4 for layer in tr["logit_lens"]["layers"])


def test_attention_past_the_budget_is_left_out_with_a_reason(client, monkeypatch):
    monkeypatch.setattr(web_app, "MAX_ATTENTION_WEIGHTS", 2 * 2 * 3 * 3)  # 3 tokens fit, 4 do not
    assert "layers" in explain(client, prompt="Every effort moves").json()["attention"]
    att = explain(client, prompt=PROMPT).json()["attention"]
    assert "layers" not in att and "up to 3 tokens" in att["omitted"]


def test_embedding_check_on_request(client):
    assert "embedding_check" not in explain(client, prompt=PROMPT).json()
    check = explain(client, prompt=PROMPT, embedding_check=True).json()["embedding_check"]
    assert check["equal_one_hot_matmul"] and check["weight_shape"] == [50257, 8]


def test_diagram_is_the_traces_svg(client):
    r = client.post("/api/diagram.svg", json={"prompt": PROMPT})
    assert r.status_code == 200 and r.headers["content-type"].startswith("image/svg+xml")
    assert r.text.startswith("<svg") and "50257" in r.text
    assert_error(client.post("/api/diagram.svg", json={"prompt": ""}), 400, "empty")


def test_classifier_shows_hidden_to_classes_and_its_labels(classifier):
    tr = classifier.post("/api/explain", json={"prompt": PROMPT}).json()
    head = next(s for s in tr["stages"] if s["name"] == "out_head")
    assert head["transition"] == "hidden->classes" and head["shape"] == [1, 4, 2] and "shared_with" not in head
    assert tr["next_token"]["kind"] == "class" and tr["next_token"]["text"] in ("ham", "spam")
    assert classifier.get("/api/model").json()["kind"] == "classifier"
    assert_error(classifier.post("/api/append", json={"prompt": PROMPT, "token": 1}), 400, "classifier")


# --- bad requests: a JSON message and a 4xx, never a crash --------------------------------

@pytest.mark.parametrize("body, words", [
    ({"prompt": ""}, ["empty"]),
    ({}, ["empty"]),
    ({"ids": []}, ["empty"]),
    ({"prompt": "x", "ids": [1]}, ["not both"]),
    ({"prompt": "a" + " a" * 16}, ["17 tokens", "16"]),
    ({"ids": [1] * 17}, ["17 tokens"]),
    ({"ids": [50257]}, ["50257", "out of range"]),
    ({"prompt": PROMPT, "block": 2}, ["block 2", "0..1"]),
])
def test_prompts_the_model_cannot_take_are_400(client, body, words):
    assert_error(explain(client, **body), 400, *words)


@pytest.mark.parametrize("body, words", [
    ({"prompt": PROMPT, "top_k": 0}, ["top_k", "greater than or equal to 1", "got 0"]),
    ({"prompt": PROMPT, "top_k": 101}, ["top_k", "100"]),
    ({"prompt": PROMPT, "top_k": "ten"}, ["top_k", '"ten"']),
    ({"prompt": PROMPT, "temperature": 0}, ["temperature", "greater than 0"]),
    ({"prompt": PROMPT, "temperature": -1}, ["temperature"]),
    ({"prompt": PROMPT, "temperature": "hot"}, ["temperature"]),
    ({"prompt": 5}, ["prompt", "string"]),
    ({"ids": [1, "two"]}, ["ids.1"]),
    ({"prompt": PROMPT, "topk": 5}, ["unknown field 'topk'", "top_k"]),
])
def test_fields_out_of_range_are_422_with_the_field_named(client, body, words):
    assert_error(explain(client, **body), 422, *words)


@pytest.mark.parametrize("raw", ['{"temperature": NaN, "prompt": "a"}', '{"temperature": Infinity, "prompt": "a"}'])
def test_non_finite_temperature_is_422(client, raw):
    assert_error(client.post("/api/explain", content=raw, headers={"content-type": "application/json"}),
                 422, "temperature")


@pytest.mark.parametrize("raw", ['{"prompt": ', "not json", '{"prompt": "a",}'])
def test_malformed_json_is_400(client, raw):
    r = client.post("/api/explain", content=raw, headers={"content-type": "application/json"})
    assert_error(r, 400, "not valid JSON")


@pytest.mark.parametrize("raw", ['["Every effort"]', '"Every effort"', "null"])
def test_a_body_that_is_not_an_object_is_400(client, raw):
    r = client.post("/api/explain", content=raw, headers={"content-type": "application/json"})
    assert_error(r, 400, "JSON object")


@pytest.mark.parametrize("prompt", ["hi <|endoftext|> there", "\ud800 lone surrogate", "\x00\n\t", "é中😀"])
def test_awkward_text_is_traced_as_plain_text(client, prompt):
    raw = json.dumps({"prompt": prompt})  # ASCII with \u escapes, so a lone surrogate can be sent
    r = client.post("/api/explain", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 200 and r.json()["tokens"]


def test_an_unexpected_failure_is_a_json_500_and_the_server_carries_on(model, tok, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    with TestClient(create_app(model, tok), raise_server_exceptions=False) as c:
        monkeypatch.setattr(web_app, "trace", broken)
        assert_error(explain(c, prompt=PROMPT), 500, "RuntimeError: boom")
        monkeypatch.undo()
        assert explain(c, prompt=PROMPT).status_code == 200


def test_append_needs_a_valid_token(client):
    assert_error(client.post("/api/append", json={"prompt": PROMPT}), 422, "token")
    assert_error(client.post("/api/append", json={"prompt": PROMPT, "token": -1}), 422, "token")
    assert_error(client.post("/api/append", json={"prompt": PROMPT, "token": 50257}), 400, "out of range")
    assert_error(client.post("/api/append", json={"prompt": "", "token": 1}), 400, "empty")


def test_configurable_prompt_limit(model, tok):
    with TestClient(create_app(model, tok, max_prompt_tokens=5)) as c:
        assert c.get("/api/model").json()["limits"]["max_prompt_tokens"] == 5
        assert explain(c, prompt=PROMPT + " to").status_code == 200  # 5 tokens
        assert_error(explain(c, prompt=PROMPT + " to the"), 400, "6 tokens", "at most 5")
        assert_error(c.post("/api/append", json={"prompt": PROMPT + " to", "token": 1}), 400, "already has 5")


def test_limit_over_the_context_is_refused(model, tok):
    with pytest.raises(GlassError, match="max_prompt_tokens"):
        create_app(model, tok, max_prompt_tokens=CFG.context_length + 1)


def test_oversized_body_is_413(model, tok):
    with TestClient(create_app(model, tok, max_body_bytes=1000)) as c:
        big = json.dumps({"prompt": "a" * 2000})
        assert_error(c.post("/api/explain", content=big, headers={"content-type": "application/json"}),
                     413, "1,000 bytes")
        # Without a Content-Length (chunked), the body is counted as it arrives.
        chunks = (big[i:i + 100].encode() for i in range(0, len(big), 100))
        assert_error(c.post("/api/explain", content=chunks, headers={"content-type": "application/json"}),
                     413, "1,000 bytes")
        assert explain(c, prompt=PROMPT).status_code == 200  # the server carries on


def test_wrong_method_and_path_are_json_errors(client):
    assert client.get("/api/explain").status_code == 405
    assert "error" in client.get("/api/explain").json()
    assert_error(client.get("/api/nothing"), 404)


# --- concurrency ------------------------------------------------------------------------

def test_concurrent_requests_from_threads_are_all_correct(model, tok):
    prompts = ["Every effort moves you", "Hello", "The cat sat on the mat", "One two three four five six",
               "GPT-2 has 124M parameters", "a b", "Where does 50,257 become 768?", "x"]
    with TestClient(create_app(model, tok)) as c:
        want = {p: explain(c, prompt=p, top_k=3).json() for p in prompts}

        def ask(i: int) -> tuple[str, dict]:
            p = prompts[i % len(prompts)]
            return p, explain(c, prompt=p, top_k=3).json()

        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(ask, range(48)))
    for p, got in results:
        assert got["tokens"] == want[p]["tokens"]
        assert got["stages"] == want[p]["stages"]
        assert got["next_token"] == want[p]["next_token"]
        assert got["attention"] == want[p]["attention"]


def test_a_slow_trace_does_not_block_the_page(model, tok, monkeypatch):
    release, started = threading.Event(), threading.Event()
    real_trace = web_app.trace

    def slow_trace(*args, **kwargs):
        started.set()
        assert release.wait(30)
        return real_trace(*args, **kwargs)

    monkeypatch.setattr(web_app, "trace", slow_trace)
    with TestClient(create_app(model, tok)) as c, ThreadPoolExecutor(2) as pool:
        slow = pool.submit(explain, c, prompt=PROMPT)
        assert started.wait(30)
        try:
            assert c.get("/").status_code == 200  # answered while the trace is still running
            assert c.get("/static/app.js").status_code == 200
            assert c.get("/api/model").status_code == 200
            assert not slow.done()
        finally:
            release.set()
        assert slow.result(30).status_code == 200


# --- glassgpt serve -----------------------------------------------------------------------

def test_serve_prints_a_loopback_url(tmp_path, monkeypatch, capsys):
    uvicorn = pytest.importorskip("uvicorn")
    from glassgpt.cli import main

    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(CFG.to_dict()))
    bound = {}

    def fake_run(self, sockets=None):
        bound["address"] = sockets[0].getsockname()
        sockets[0].close()

    monkeypatch.setattr(uvicorn.Server, "run", fake_run)
    assert main(["serve", "--model", str(config), "--port", "0"]) == 0
    out = capsys.readouterr().out
    host, port = bound["address"][:2]
    assert host == "127.0.0.1" and port > 0
    assert f"http://127.0.0.1:{port}/" in out


def test_serve_without_uvicorn_says_what_to_install(monkeypatch, capsys):
    import sys

    from glassgpt.cli import main

    monkeypatch.setitem(sys.modules, "uvicorn", None)  # makes `import uvicorn` raise ImportError
    assert main(["serve", "--model", "gpt2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'glassgpt[web]'" in err[0]


def test_serve_on_a_busy_port_is_one_line(monkeypatch, capsys, tmp_path):
    import socket

    pytest.importorskip("uvicorn")
    from glassgpt.cli import main

    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(CFG.to_dict()))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--model", str(config), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"127.0.0.1:{port}" in err and "--port" in err
