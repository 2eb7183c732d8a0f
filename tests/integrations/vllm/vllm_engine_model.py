"""A tiny random-weight LLaVA that a real vLLM engine serves on CPU, built locally.

A CLIP vision tower (32x32 images, 8x8 patches: 16 image tokens), a two-layer Llama decoder
(hidden size 128), a tokenizer trained here with the `tokenizers` library, and a CLIP image
processor: about 420k parameters, written with ``save_pretrained`` so vLLM loads it like any
checkpoint. Nothing is downloaded.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

IMAGE_TOKEN = "<image>"
IMAGE_SIZE = 32
PATCH = 8
IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2
VOCAB = 300
_SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", IMAGE_TOKEN]
_CORPUS = [
    "describe the picture in a few words",
    "what is in this image and where is it",
    "a red square on a blue field with a green line",
    "the quick brown fox jumps over the lazy dog",
    "count the shapes and name their colours",
]


def count_tower_calls(model: Any) -> int:
    """Install (once) a forward hook that counts the images the vision tower encodes; the count.

    For ``LLM.apply_model``: it runs in the engine's worker processes, so it lives in a module
    they import by name."""
    tower = model.vision_tower
    if not hasattr(tower, "_mmkey_images"):
        tower._mmkey_images = 0

        def hook(module: Any, args: Any, output: Any) -> None:
            pixels: Any = args[0] if args else None
            module._mmkey_images += int(pixels.shape[0]) if hasattr(pixels, "shape") else 1

        tower.register_forward_hook(hook)
    return int(tower._mmkey_images)


def _untyped(module: str) -> Any:
    """A module of the engine's environment that has no type information here."""
    return importlib.import_module(module)


def _train_tokenizer(out: Path) -> int:
    """A byte-level BPE tokenizer trained on a few lines; returns the image token's id."""
    tokenizers = _untyped("tokenizers")
    Tokenizer, decoders, models = tokenizers.Tokenizer, tokenizers.decoders, tokenizers.models
    pre_tokenizers, trainers = tokenizers.pre_tokenizers, tokenizers.trainers
    PreTrainedTokenizerFast = _untyped("transformers").PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - len(_SPECIALS),
        special_tokens=_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        extra_special_tokens={"image_token": IMAGE_TOKEN},
    )
    fast.save_pretrained(out)
    image_id = tok.token_to_id(IMAGE_TOKEN)
    assert isinstance(image_id, int) and tok.get_vocab_size() <= VOCAB
    return image_id


def build_tiny_llava(
    out: Path,
    *,
    seed: int = 0,
    image_size: int = IMAGE_SIZE,
    patch: int = PATCH,
    tower_hidden: int = 32,
    tower_layers: int = 2,
    tower_heads: int = 2,
    tower_intermediate: int | None = None,
    max_positions: int = 512,
) -> Path:
    """Write the model, its tokenizer and its processor into `out`; returns `out`.

    The tower's sizes can be raised (a benchmark wants a tower whose cost matters; the MLP is
    twice the width unless `tower_intermediate` says), and the decoder's context with them
    (``max_positions``: more image tokens than 512)."""
    import torch

    safetensors = _untyped("safetensors.torch")
    load_file, save_file = safetensors.load_file, safetensors.save_file
    tf = _untyped("transformers")
    CLIPImageProcessor, CLIPVisionConfig, LlamaConfig = (
        tf.CLIPImageProcessor,
        tf.CLIPVisionConfig,
        tf.LlamaConfig,
    )
    LlavaConfig, LlavaForConditionalGeneration = tf.LlavaConfig, tf.LlavaForConditionalGeneration
    LlavaProcessor, PreTrainedTokenizerFast = tf.LlavaProcessor, tf.PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    image_id = _train_tokenizer(out)
    torch.manual_seed(seed)
    vision = CLIPVisionConfig(
        hidden_size=tower_hidden,
        intermediate_size=2 * tower_hidden if tower_intermediate is None else tower_intermediate,
        num_hidden_layers=tower_layers,
        num_attention_heads=tower_heads,
        image_size=image_size,
        patch_size=patch,
        projection_dim=32,
    )
    text = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=max_positions,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
    )
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_id)
    model = LlavaForConditionalGeneration(config)
    # random weights scaled up so that different images give different next tokens
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "multi_modal_projector" in name and name.endswith("weight"):
                param.mul_(8.0)
    model.save_pretrained(out)
    # transformers writes the CLIP tower without its `vision_model.` level; vLLM expects it
    weights = out / "model.safetensors"
    state = load_file(weights)
    renamed = {
        (f"vision_tower.vision_model.{k[len('vision_tower.') :]}" if k.startswith("vision_tower.") else k): v
        for k, v in state.items()
    }
    save_file(renamed, weights, metadata={"format": "pt"})
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(
            size={"shortest_edge": image_size},
            crop_size={"height": image_size, "width": image_size},
        ),
        tokenizer=PreTrainedTokenizerFast.from_pretrained(out),
        patch_size=patch,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=None,
    )
    processor.save_pretrained(out)
    meta = {"image_token_id": image_id, "image_tokens": (image_size // patch) ** 2}
    (out / "mmkey-test-model.json").write_text(json.dumps(meta))
    return out


if __name__ == "__main__":
    import sys

    print(build_tiny_llava(Path(sys.argv[1])))
