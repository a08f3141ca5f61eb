"""EPD and image-input launch flags: SGLang's names, and refusals that name the flag and say why."""

from __future__ import annotations

import pytest

from engine.server.args import ArgumentError, parse_args

M = ["--model-path", "m"]


def test_epd_flags_parse_with_upstream_names():
    p = parse_args(
        [*M, "--disaggregation-mode", "prefill", "--language-only", "--encoder-urls", "http://a:1", "http://b:2",
         "--encoder-transfer-backend", "zmq_to_scheduler"]
    )  # fmt: skip
    assert p.language_only and p.encoder_urls == ["http://a:1", "http://b:2"]
    assert p.to_dict()["encoder_transfer_backend"] == "zmq_to_scheduler"
    assert parse_args([*M, "--encoder-only"]).encoder_only
    for role in (["--encoder-only"], ["--language-only", "--encoder-urls", "http://a:1"]):
        assert (
            parse_args([*M, *role, "--encoder-transfer-backend", "mooncake"]).encoder_transfer_backend
            == "mooncake"
        )
    assert parse_args([*M, "--limit-mm-data-per-request", '{"image": 3}']).max_images_per_request == 3


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (
            ["--encoder-transfer-backend", "mooncake"],
            "--encoder-transfer-backend mooncake: only an --encoder-only",
        ),
        (
            ["--encoder-transfer-backend", "zmq_to_tokenizer"],
            "zmq_to_tokenizer: not supported by KVFleet; a worker",
        ),
        (["--enable-mm-global-cache"], "--enable-mm-global-cache: only an --encoder-only worker"),
        (["--grpc-mode", "--encoder-only"], "--grpc-mode: only a regular worker serves gRPC"),
        (["--language-only"], "--language-only needs --encoder-urls"),
        (["--encoder-urls", "http://a:1"], "--encoder-urls needs --language-only"),
        (["--language-only", "--encoder-urls", "a:1"], "--encoder-urls a:1: expected http://host:port"),
        (["--encoder-only", "--language-only"], "exclude each other"),
        (["--limit-mm-data-per-request", '{"video": 1}'], "--limit-mm-data-per-request"),
        (["--allowed-local-media-path", "/nonexistent-dir"], "--allowed-local-media-path /nonexistent-dir"),
    ],
)
def test_bad_epd_flags_name_the_flag(flags, words):
    with pytest.raises(ArgumentError) as err:
        parse_args([*M, *flags])
    assert words in str(err.value)
