"""Constrained decoding and tool calls.

``backend.GrammarBackend`` compiles ``json_schema`` / ``regex`` / ``ebnf`` / ``structural_tag`` constraints
with xgrammar on a thread pool and caches them by (kind, text); ``state.GrammarState`` is one request's
matcher and ``state.apply_vocab_masks`` masks a batch's logits before sampling. ``tools`` builds the
constraint that ``tool_choice`` asks for; ``tool_parsers`` finds tool calls in a model's text
(``--tool-call-parser``). The package imports nothing heavy itself, so the launch flags can name the parsers
without loading torch.
"""
