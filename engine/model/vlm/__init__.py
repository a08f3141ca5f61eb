"""Vision-language models: the LLaVA family (CLIP vision tower + MLP projector over the Llama decoder).

``config`` reads the vision and processor settings, ``processor`` turns image bytes into pixels and a content
hash, ``clip`` runs the vision tower and projector, ``mm`` lays image tokens into a prompt and their
embeddings into a batch.
"""
