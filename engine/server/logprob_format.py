"""Log-probabilities in the shapes clients read: SGLang's ``meta_info`` fields and OpenAI's ``logprobs``.

SGLang (``/generate`` with ``return_logprob``): ``input_token_logprobs`` / ``output_token_logprobs`` are lists
of ``[logprob, token_id, text]`` (text None unless ``return_text_in_logprobs``; the first input entry's
logprob is None); with ``top_logprobs_num`` > 0, ``input_top_logprobs`` / ``output_top_logprobs`` hold per
position a list of such triples, best first (None for the first input position); with ``token_ids_logprob``,
``input_token_ids_logprobs`` / ``output_token_ids_logprobs`` hold per position the triples of the requested
ids. OpenAI: chat's ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`` and completions'
``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``.
"""

from __future__ import annotations

from engine.scheduler.logprobs import LogprobRequest, LogprobValues


class _Texts:
    """Token text, decoded one id at a time and remembered."""

    def __init__(self, engine, enabled: bool) -> None:
        self.engine, self.enabled = engine, enabled
        self.known: dict[int, str] = {}

    def __call__(self, tok: int) -> str | None:
        if not self.enabled:
            return None
        if tok not in self.known:
            self.known[tok] = self.engine.decode([tok], skip_special_tokens=False)
        return self.known[tok]


def sglang_meta(
    engine, want: LogprobRequest, values: dict, prompt: list[int], output: list[int], return_text: bool
) -> dict:
    """The ``meta_info`` fields of ``values`` (``Engine.generate``'s ``logprobs``) for ``prompt`` and the
    ``output`` ids. On a decode worker ``input_token_logprobs`` is empty: the sglang-router puts the prefill
    worker's answer's there (it prepends P's list to D's), while the other input fields, which the router does
    not merge, are D's copy of P's values (sent with the KV)."""
    text = _Texts(engine, return_text)
    inp: LogprobValues = values["input"]
    out: LogprobValues = values["output"]
    in_ids = prompt[want.start : want.start + len(inp)]
    meta: dict[str, list] = {
        "input_token_logprobs": []
        if engine.args.disaggregation_mode == "decode"
        else [[lp, t, text(t)] for lp, t in zip(inp.token, in_ids, strict=True)],
        "output_token_logprobs": [[lp, t, text(t)] for lp, t in zip(out.token, output, strict=False)],
    }
    if want.top_n > 0:
        meta["input_top_logprobs"] = [_triples(e, text) for e in inp.top]
        meta["output_top_logprobs"] = [_triples(e, text) for e in out.top]
    if want.token_ids is not None:
        ids = list(want.token_ids)
        meta["input_token_ids_logprobs"] = [_triples((v, ids), text) if v else None for v in inp.ids]
        meta["output_token_ids_logprobs"] = [_triples((v, ids), text) if v else None for v in out.ids]
    return meta


def _triples(entry, text) -> list | None:
    if entry is None:
        return None
    vals, ids = entry
    return [[v, t, text(t)] for v, t in zip(vals, ids, strict=True)]


def openai_chat(engine, values: LogprobValues, output: list[int]) -> dict:
    """Chat's ``choices[i].logprobs``: one ``content`` item per output token."""
    text = _Texts(engine, True)
    content = []
    for lp, tok, top in zip(values.token, output, values.top, strict=False):
        item = _chat_item(text(tok) or "", lp)
        item["top_logprobs"] = (
            [_chat_item(text(t) or "", v) for v, t in zip(*top, strict=True)] if top else []
        )
        content.append(item)
    return {"content": content}


def _chat_item(token: str, logprob: float | None) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def openai_completion(
    engine, inp: LogprobValues | None, prompt: list[int], out: LogprobValues, output: list[int], offset: int
) -> dict:
    """Completions' ``choices[i].logprobs`` over the echoed prompt (``inp`` from its first token, the first
    logprob None, or None when not echoed) and the output. ``text_offset``: each token's character offset in
    the choice's text, counted from ``offset``; ``top_logprobs``: per token ``{token text: logprob}`` (None
    for the first prompt token, and everywhere when no top logprobs were asked)."""
    text = _Texts(engine, True)
    tokens, lps, tops, offsets = [], [], [], []
    pos = offset
    runs = [(out, output)] if inp is None else [(inp, prompt), (out, output)]
    for values, ids in runs:
        for lp, tok, top in zip(values.token, ids, values.top, strict=False):
            piece = text(tok) or ""
            tokens.append(piece)
            lps.append(lp)
            tops.append({text(t): v for v, t in zip(*top, strict=True)} if top else None)
            offsets.append(pos)
            pos += len(piece)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}
