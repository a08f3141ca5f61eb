"""Llama-family model layer: config, loaders, tokenizer, attention backends and the ModelRunner."""
