"""``n > 1`` through sglang-router's PD mode: the router turns it into lists of ``n`` bootstrap hosts, ports
and rooms; a PD worker answers 400 naming ``n`` (unsupported in PD mode), not the lists."""

from __future__ import annotations

import pytest

PD = ["--disaggregation-transfer-backend", "fake", "--page-size", "16", "--max-total-tokens", "512"]
MODES = {"prefill": ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", "0"],
         "decode": ["--disaggregation-mode", "decode"]}  # fmt: skip
LISTS = {"bootstrap_host": ["127.0.0.1"] * 2, "bootstrap_port": [8998] * 2, "bootstrap_room": [11, 12]}
CASES = [
    ("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 2, "n": 2}}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "n": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "n": 2}),
]


@pytest.mark.parametrize("mode", MODES)
def test_n_2_with_the_routers_bootstrap_lists_names_n(serve, mode):
    _, client = serve(*PD, *MODES[mode])
    for path, body in CASES:
        resp = client.post(path, json={**body, **LISTS})
        assert resp.status_code == 400, (path, resp.text)
        message = resp.json()["error"]["message"]
        expected = "sampling_params.n=2" if path == "/generate" else "n=2"
        assert message == f"{expected} is not supported in PD mode", (path, message)


def test_bootstrap_lists_with_n_1_still_name_the_lists(serve):
    _, client = serve(*PD, *MODES["decode"])
    resp = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "n": 1, **LISTS})
    assert resp.status_code == 400
    assert "bootstrap_host" in resp.json()["error"]["message"]
