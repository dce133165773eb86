"""Bad client input gets a 4xx with a message (never a 500) and reaches no instance."""

from __future__ import annotations

import pytest

BAD = [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (b'{"model": "m"}', "'prompt' is required"),
    (b'{"prompt": ""}', "'prompt' is empty"),
    (b'{"prompt": ["a", "b"]}', "one prompt per request"),
    (b'{"prompt": [1, "x"]}', "non-empty string or a non-empty list"),
    (b'{"prompt": "a", "max_tokens": 0}', "'max_tokens' must be a positive integer"),
    (b'{"prompt": "a", "max_tokens": "5"}', "'max_tokens' must be a positive integer"),
    (b'{"prompt": "a", "stream": "yes"}', "'stream' must be true or false"),
    (b'{"prompt": "a", "n": 3}', "'n' = 3 is not supported"),
    (b'{"prompt": "a", "model": 5}', "'model' must be a string"),
    (b'{"prompt": "a", "kv_transfer_params": {"do_remote_decode": true}}', "set by the router"),
    (b'\xff\xfe', "not valid JSON"),
]


@pytest.mark.parametrize("raw,msg", BAD)
def test_bad_completion_body_is_a_400_with_a_message(make_cluster, raw, msg):
    c = make_cluster(1, 1)
    with c.client() as http:
        r = http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert msg in err["message"] and err["type"] == "invalid_request_error"
    assert c.prefill[0].generation_requests() == [] and c.decode[0].generation_requests() == []
    assert c.error_count("bad_request") == 1


@pytest.mark.parametrize("body,msg", [
    ({"model": "m"}, "'messages' is required"),
    ({"messages": []}, "non-empty list"),
    ({"messages": ["hi"]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1},
     "'max_completion_tokens' must be a positive integer"),
])
def test_bad_chat_body_is_a_400(make_cluster, body, msg):
    c = make_cluster(1, 1)
    with c.client() as http:
        r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and msg in r.json()["error"]["message"]


def test_wrong_method_unknown_path_and_huge_body(make_cluster):
    c = make_cluster(1, 1, max_body_bytes=1000)
    with c.client() as http:
        assert http.get("/v1/completions").status_code == 405
        assert http.post("/v1/embeddings", json={}).status_code == 404
        r = http.post("/v1/completions", json={"prompt": "x" * 5000})
        assert r.status_code == 413 and "max_body_bytes" in r.json()["error"]["message"]
    assert c.decode[0].generation_requests() == []
