"""The Qwen-Image family: Qwen2.5-VL text encoder, the Qwen-Image DiT and VAE, flow-matching
Euler with a resolution-dependent shift, and true CFG with a norm rescale.

``build`` makes a tiny random pipeline with the real checkpoint's component classes (the
tokenizer too: a byte-level BPE trained locally); a real ``Qwen/Qwen-Image`` folder loads
through the same ``from_pretrained`` path. The stage code reproduces ``QwenImagePipeline``
(diffusers 0.42) step for step, ``QwenImageImg2ImgPipeline`` for a request that starts
from an input image and ``QwenImageInpaintPipeline`` for one with a mask too, which makes
outputs bit-identical to them.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from keys import Fingerprint, GenerationSpec, StepCache, digest
from workers.families.base import (
    CPU,
    Family,
    Placement,
    Tokens,
    Trainable,
    check_condition,
    component_config,
    component_fingerprint,
    placed_pipeline,
    sibling_pipeline,
    to_uint8,
    vae_encode_fingerprint,
)
from workers.families.scheduler_state import SchedulerFields
from workers.families.step_cache import hook_config, hooks_enabled
from workers.queue.served_model import FamilyLimits, ModelGeometry, Workflow, model_card

# QwenImagePipeline's prompt template; its first DROP_IDX tokens (the system prompt) are
# dropped from the text encoder's hidden states.
TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, "
            "texture, quantity, text, spatial relationships of the objects and background:"
            "<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n")
DROP_IDX = 34
# The trained model the "shapes" preset installs (package data).
TRAINED = Path(__file__).parent / "trained" / "shapes"
TOKENIZER_MAX_LENGTH = 1024
MAX_SEQUENCE_LENGTH = 512  # what __call__ cuts embeddings to
TYPICAL_PROMPT_TOKENS = 12  # a short caption, after the template is dropped
# Qwen/Qwen-Image's scheduler_config.json (diffusers ships no copy of it).
SCHEDULER_CONFIG: dict[str, Any] = {
    "base_image_seq_len": 256, "base_shift": 0.5, "invert_sigmas": False,
    "max_image_seq_len": 8192, "max_shift": 0.9, "num_train_timesteps": 1000, "shift": 1.0,
    "shift_terminal": 0.02, "stochastic_sampling": False, "time_shift_type": "exponential",
    "use_beta_sigmas": False, "use_dynamic_shifting": True, "use_exponential_sigmas": False,
    "use_karras_sigmas": False}
# The Qwen2.5-VL tokenizer's added tokens, in the real order after the BPE vocabulary.
SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
    "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>",
    "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]


@dataclass(frozen=True, slots=True)
class QwenPreset:
    vocab_words: int
    bpe_vocab: int
    text_hidden: int
    text_layers: int
    dit_layers: int
    dit_heads: int
    dit_head_dim: int
    vae_base_dim: int
    vae_dim_mult: tuple[int, ...] = (1, 2, 4, 4)  # one downsampling less per entry less


PRESETS = {
    # Sized, as Wan's default is, so that denoise dominates a request's compute as on the
    # real model.
    "default": QwenPreset(vocab_words=4000, bpe_vocab=6000, text_hidden=64, text_layers=2,
                          dit_layers=12, dit_heads=4, dit_head_dim=32, vae_base_dim=8),
    "test": QwenPreset(vocab_words=4000, bpe_vocab=6000, text_hidden=32, text_layers=2,
                       dit_layers=2, dit_heads=2, dit_head_dim=16, vae_base_dim=4),
    # The architecture `diffcache model train` trains on 32x32 scenes: a VAE that
    # downsamples by 4, not 8, so the DiT sees 4x4 patches rather than 2x2.
    "shapes": QwenPreset(vocab_words=4000, bpe_vocab=6000, text_hidden=64, text_layers=2,
                         dit_layers=6, dit_heads=4, dit_head_dim=32, vae_base_dim=16,
                         vae_dim_mult=(1, 2, 4)),
}


def template_prefix(template: str) -> str:
    """What a pipeline drops of ``template``'s hidden states: all before the user's part (its
    image, where it takes one; else its text)."""
    return template[:template.index("<|vision_start|>" if "<|vision_start|>" in template
                                    else "{}")]


def _tokenizer(preset: QwenPreset, template: str = TEMPLATE, drop_idx: int = DROP_IDX) -> Any:
    """A ``Qwen2Tokenizer`` (byte-level BPE with Qwen2's pre-tokenizer), trained offline on
    common English words and the prompt ``template``, so the template's system prefix is
    exactly ``drop_idx`` tokens, as with the real tokenizer."""
    import wordfreq
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
    from tokenizers.models import BPE
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="",
                        fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    words = wordfreq.top_n_list("en", preset.vocab_words)
    plain = template
    for special in SPECIAL_TOKENS:
        plain = plain.replace(special, "")
    corpus = [plain] * 200
    corpus += [" ".join(words[i:i + 50]) for i in range(0, len(words), 50)]
    corpus += [" " + w.capitalize() for w in words[:1000]]
    tok.train_from_iterator(corpus, trainer=trainers.BpeTrainer(
        vocab_size=preset.bpe_vocab, min_frequency=1, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[]))
    model = json.loads(tok.to_str())["model"]
    merges: Any = [tuple(m) if isinstance(m, list) else tuple(m.split(" "))
                   for m in model["merges"]]
    tokenizer = Qwen2Tokenizer(vocab=model["vocab"], merges=merges, unk_token=SPECIAL_TOKENS[0],
                               eos_token=SPECIAL_TOKENS[0], pad_token=SPECIAL_TOKENS[0],
                               model_max_length=131072)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[1:]})
    tokenizer.eos_token = "<|im_end|>"  # as in Qwen2.5-VL-Instruct's tokenizer_config
    if len(tokenizer(template_prefix(template)).input_ids) != drop_idx:
        raise RuntimeError(f"the template's system prefix must be {drop_idx} tokens")
    return tokenizer


def build(directory: Path, preset_name: str, seed: int = 0) -> None:
    """Install a model of the preset: the trained shapes model shipped with the project, or a
    tiny random pipeline built from ``seed``, saved with ``save_pretrained``."""
    if preset_name == "shapes":
        install_trained(directory)
    else:
        untrained(preset_name, seed).save_pretrained(directory)


def install_trained(directory: Path) -> None:
    """Copy the shipped trained model (``diffcache model train`` made it) into ``directory``."""
    if not (TRAINED / "model_index.json").exists():
        raise FileNotFoundError(f"the trained shapes model is missing from {TRAINED}; remake "
                                f"it with `diffcache model train --out {TRAINED}`")
    shutil.copytree(TRAINED, directory, dirs_exist_ok=True)


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) latents to the DiT's (B, H/2 * W/2, 4C) tokens of 2x2 patches, as
    ``QwenImagePipeline._pack_latents`` packs them."""
    b, c, h, w = latents.shape
    packed = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return packed.reshape(b, (h // 2) * (w // 2), c * 4)


def untrained(preset_name: str, seed: int) -> Any:
    """``untrained_pipeline`` of a preset named (``Trainable.untrained``)."""
    return untrained_pipeline(PRESETS[preset_name], seed)


def untrained_pipeline(preset: QwenPreset, seed: int) -> Any:
    """A ``QwenImagePipeline`` of the preset's sizes with random weights drawn from ``seed``."""
    from diffusers import QwenImagePipeline

    pipe: Any = QwenImagePipeline(**untrained_components(preset, seed, TEMPLATE, DROP_IDX))
    if (pipe.prompt_template_encode != TEMPLATE
            or pipe.prompt_template_encode_start_idx != DROP_IDX):
        raise RuntimeError("QwenImagePipeline's prompt template changed; update this family")
    return pipe


def untrained_components(preset: QwenPreset, seed: int, template: str, drop_idx: int
                         ) -> dict[str, Any]:
    """The components of a Qwen-Image pipeline of the preset's sizes, with random weights
    drawn from ``seed`` and a tokenizer trained for ``template``."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    tokenizer = _tokenizer(preset, template, drop_idx)
    ids = {s: tokenizer.convert_tokens_to_ids(s) for s in SPECIAL_TOKENS}
    heads = 2
    half = preset.text_hidden // heads // 2  # rotary pairs per head, split t/h/w as mrope does
    mrope = [half - 2 * (3 * half // 8), 3 * half // 8, 3 * half // 8]
    text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer), "hidden_size": preset.text_hidden,
            "intermediate_size": 2 * preset.text_hidden,
            "num_hidden_layers": preset.text_layers, "num_attention_heads": heads,
            "num_key_value_heads": 1, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                                "mrope_section": mrope},
            "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"], "max_window_layers": preset.text_layers},
        vision_config={
            "depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
            "out_hidden_size": preset.text_hidden, "patch_size": 14, "spatial_merge_size": 2,
            "temporal_patch_size": 2, "window_size": 112, "fullatt_block_indexes": [0]},
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"])).eval()
    d = preset.dit_head_dim
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=64, out_channels=16, num_layers=preset.dit_layers,
        attention_head_dim=d, num_attention_heads=preset.dit_heads,
        joint_attention_dim=preset.text_hidden, guidance_embeds=False,
        axes_dims_rope=(d // 4, 3 * d // 8, 3 * d // 8))
    downsamples = len(preset.vae_dim_mult) - 1
    vae = AutoencoderKLQwenImage(base_dim=preset.vae_base_dim, z_dim=16,
                                 dim_mult=list(preset.vae_dim_mult), num_res_blocks=1,
                                 temperal_downsample=[False] + [True] * (downsamples - 1))
    return dict(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG), vae=vae,
                text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)


# --- Encode ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class QwenTokens:
    ids: tuple[int, ...]
    mask: tuple[int, ...]


class QwenTextEncoder:
    """Qwen2.5-VL conditioning exactly as ``QwenImagePipeline.encode_prompt`` computes it for
    one text: the template, the last hidden state, the system prefix dropped, cut to 512."""

    max_length = MAX_SEQUENCE_LENGTH

    def __init__(self, directory: Path, placement: Placement = CPU) -> None:
        from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

        self.device = placement.device
        self.tokenizer = Qwen2Tokenizer.from_pretrained(directory / "tokenizer")
        model: Any = Qwen2_5_VLForConditionalGeneration.from_pretrained(
            directory / "text_encoder", dtype=placement.text_dtype)
        self.model = model.to(self.device).eval()
        self.fingerprint = component_fingerprint(directory, "text_encoder", self.model.dtype,
                                                 self.device)

    def tokenize(self, text: str) -> QwenTokens:
        out = self.tokenizer([TEMPLATE.format(text)], max_length=TOKENIZER_MAX_LENGTH + DROP_IDX,
                             padding=True, truncation=True, return_tensors="pt")
        return QwenTokens(tuple(out.input_ids[0].tolist()),
                          tuple(out.attention_mask[0].tolist()))

    @torch.no_grad()
    def encode(self, tokens: Tokens) -> torch.Tensor:
        ids = torch.tensor([list(tokens.ids)], device=self.device)
        mask = torch.tensor([list(tokens.mask)], device=self.device)
        hidden = self.model(input_ids=ids, attention_mask=mask,
                            output_hidden_states=True).hidden_states[-1]
        # One text, no padding: the pipeline's mask selection keeps every position.
        selected = hidden[mask.bool()][DROP_IDX:]
        embeds = selected.unsqueeze(0).to(self.model.dtype)
        return embeds[:, :MAX_SEQUENCE_LENGTH].contiguous()

    def text_positions(self, tokens: Tokens, embedding: torch.Tensor) -> int:
        """The embedding's positions that hold the text: all (``encode`` keeps no padding)."""
        return int(embedding.shape[-2])


def in_model_dtype(placement: Placement) -> Placement:
    """Qwen-Image's placement of its VAE: in the model's dtype, as its pipelines run it (they
    cast an input image to the prompt's dtype before encoding it, and are run in bfloat16
    whole), where Wan's keep theirs in float32."""
    encoders = None if placement.encoders is None else in_model_dtype(placement.encoders)
    return dataclasses.replace(placement, vae_dtype=placement.dit_dtype, encoders=encoders)


def image_encoder_fingerprint(directory: Path, placement: Placement) -> Fingerprint:
    """The VAE as it encodes an input image; the pipeline casts the pixels to the prompt
    embeddings' dtype first."""
    return vae_encode_fingerprint(directory, placement, placement.text_dtype,
                                  "latent distribution")


def mask_fingerprint(directory: Path, placement: Placement) -> Fingerprint:
    """How an inpainting mask becomes the latents' mask: the pipeline's mask processor
    (grey, resized, binarised at half) at the VAE's scale, brought to the latents' size by
    nearest neighbour, in the prompt embeddings' dtype."""
    scale = 2 ** len(component_config(directory, "vae")["temperal_downsample"])
    return Fingerprint("inpaint-mask", digest("inpaint-mask", {
        "vae_scale_factor": scale, "dtype": str(placement.text_dtype),
        "processor": "VaeImageProcessor(do_binarize, do_convert_grayscale, no normalize)",
        "to_latents": "interpolate(nearest)"}))


class QwenImageEncoder:
    """The Qwen-Image VAE's encoding of an input image, as ``QwenImageImg2ImgPipeline``
    prepares it: resized and scaled to [-1, 1] by the pipeline's image processor, cast to
    the prompt embeddings' dtype, encoded to the latent distribution it samples from."""

    def __init__(self, directory: Path, placement: Placement = CPU) -> None:
        from diffusers import AutoencoderKLQwenImage
        from diffusers.image_processor import VaeImageProcessor

        placement = in_model_dtype(placement)
        self.device = placement.device
        self.dtype = placement.text_dtype
        self.vae = AutoencoderKLQwenImage.from_pretrained(
            directory / "vae", dtype=placement.vae_dtype).to(self.device).eval()
        self.scale_factor = 2 ** len(self.vae.temperal_downsample)
        self.processor = VaeImageProcessor(vae_scale_factor=self.scale_factor * 2,
                                           vae_latent_channels=self.vae.config.z_dim)
        # QwenImageInpaintPipeline's: a mask is read grey, and binarised after its resize.
        self.mask_processor = VaeImageProcessor(
            vae_scale_factor=self.scale_factor * 2, vae_latent_channels=self.vae.config.z_dim,
            do_normalize=False, do_binarize=True, do_convert_grayscale=True)
        self.fingerprint = image_encoder_fingerprint(directory, placement)
        self.sized_by_output = True
        self.mask_fingerprint: Fingerprint | None = mask_fingerprint(directory, placement)

    @torch.no_grad()
    def encode(self, image: Image.Image, width: int, height: int, frames: int) -> torch.Tensor:
        pixels = self.processor.preprocess(image, height=height, width=width)
        pixels = pixels.to(torch.float32).unsqueeze(2).to(self.device, self.dtype)
        parameters: torch.Tensor = self.vae.encode(pixels.to(self.vae.dtype)).latent_dist \
            .parameters
        return parameters.contiguous()

    @torch.no_grad()
    def encode_mask(self, mask: Image.Image, width: int, height: int) -> torch.Tensor:
        """(1, 1, latent height, latent width), as ``prepare_mask_latents`` resizes it before
        repeating it over the channels."""
        pixels = self.mask_processor.preprocess(mask, height=height, width=width)
        f = self.scale_factor * 2
        size = (2 * (height // f), 2 * (width // f))
        return torch.nn.functional.interpolate(pixels, size=size).to(self.device, self.dtype) \
            .contiguous()


# --- Denoise --------------------------------------------------------------------------------


def _calculate_shift(seq_len: int, config: dict[str, Any]) -> float:
    """The pipeline's ``calculate_shift``: ``mu`` grows with the image's token count."""
    base, top = config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096)
    low, high = config.get("base_shift", 0.5), config.get("max_shift", 1.15)
    m = (high - low) / (top - base)
    return float(seq_len * m + (low - m * base))


class QwenTrajectory:
    """What names a trajectory and its output, read from the model's files."""

    # Flow-matching Euler is first-order: its step index is all it keeps between steps.
    scheduler_fields = SchedulerFields(counters=("_step_index",))

    def __init__(self, directory: Path, placement: Placement = CPU) -> None:
        from diffusers import FlowMatchEulerDiscreteScheduler

        placement = in_model_dtype(placement)
        self.device = placement.device
        self.placement = placement
        self.mag_ratios = model_card(directory).magcache_ratios
        self._scheduler_cls = FlowMatchEulerDiscreteScheduler
        self.scheduler_config = dict(FlowMatchEulerDiscreteScheduler.load_config(
            directory / "scheduler"))
        vae_config = json.loads((directory / "vae" / "config.json").read_text())
        # 2 ** len(...), as the pipeline computes it (not the sum of the downsampling flags).
        self.vae_scale_factor = 2 ** len(vae_config["temperal_downsample"])
        # How an input image's VAE sample is normalised into the DiT's latent space.
        self.latents_mean = torch.tensor(vae_config["latents_mean"]).view(1, -1, 1, 1, 1)
        self.latents_std = torch.tensor(vae_config["latents_std"]).view(1, -1, 1, 1, 1)
        self.fingerprint = component_fingerprint(directory, "transformer",
                                                 placement.dit_dtype, self.device,
                                                 placement.dit_split)
        self.decoder_fingerprint = component_fingerprint(directory, "vae", placement.vae_dtype,
                                                         self.device)
        self.image_fingerprint: Fingerprint | None = image_encoder_fingerprint(
            directory, placement.encoding)  # the image's encoder runs with the encoders

    def tokens_per_side(self, spec: GenerationSpec) -> tuple[int, int]:
        """Packed latent tokens along the height and the width."""
        f = self.vae_scale_factor * 2
        return spec.height // f, spec.width // f

    def scheduler(self, spec: GenerationSpec) -> Any:
        rows, cols = self.tokens_per_side(spec)
        steps = spec.num_inference_steps
        scheduler = self._scheduler_cls.from_config(self.scheduler_config)
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps),
                                device=self.device,
                                mu=_calculate_shift(rows * cols, self.scheduler_config))
        # Image-to-image starts part of the way down: the first timestep it runs is where
        # its input image is noised to (``initial_latents``).
        scheduler.set_begin_index(spec.first_step)
        return scheduler


@dataclass(frozen=True, slots=True)
class QwenInpainting:
    """``QwenImageInpaintPipeline``'s blend after each step (for a DiT of 64 channels, which
    takes no mask): where ``mask`` is 0 the latents are the input image's sample noised to
    the next step's sigma, or the sample itself after the last step."""

    image: torch.Tensor  # packed, as the latents
    noise: torch.Tensor
    mask: torch.Tensor  # 1 where the prompt repaints

    def keep(self, latents: torch.Tensor, scheduler: Any, step: int) -> torch.Tensor:
        proper = self.image
        if step + 1 < len(scheduler.timesteps):
            # The scheduler has stepped: ``scale_noise`` takes its sigma at the next step.
            proper = scheduler.scale_noise(proper, scheduler.timesteps[step + 1:step + 2],
                                           self.noise)
        return (1 - self.mask) * proper + self.mask * latents


class QwenDenoiser(QwenTrajectory):
    """The Qwen-Image DiT over packed 2x2 latent patches."""

    pads_text = True

    def __init__(self, directory: Path, placement: Placement = CPU) -> None:
        from diffusers import QwenImageTransformer2DModel

        super().__init__(directory, placement)
        self.transformer = QwenImageTransformer2DModel.from_pretrained(
            directory / "transformer", dtype=placement.dit_dtype).to(self.device).eval()

    def latent_shape(self, spec: GenerationSpec) -> tuple[int, ...]:
        rows, cols = self.tokens_per_side(spec)
        return (1, rows * cols, self.transformer.config.in_channels)

    def initial_latents(self, spec: GenerationSpec, image: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Generator]:
        """``prepare_latents``: noise over (1, 1, C, 2 rows, 2 cols) from a CPU generator
        seeded once, in the text encoder's dtype (the pipeline draws it in the prompt
        embeddings' dtype), then packed into 2x2 patches. For image-to-image
        (``QwenImageImg2ImgPipeline``, and ``QwenImageInpaintPipeline`` alike), the same
        generator first samples the image's latent distribution, and the noise is mixed into
        that sample at the first step's sigma."""

        if spec.image is None:
            return self.pure_noise(spec)
        start, noise, generator = self._image_start(spec, image)
        scheduler = self.scheduler(spec)
        t = scheduler.timesteps[spec.first_step:spec.first_step + 1]
        return pack_latents(scheduler.scale_noise(start, t, noise)[:, 0]), generator

    def pure_noise(self, spec: GenerationSpec) -> tuple[torch.Tensor, torch.Generator]:
        """Text-to-image's start: the seed's noise, packed, and the generator after it."""
        from diffusers.utils.torch_utils import randn_tensor

        generator = torch.Generator(device="cpu").manual_seed(spec.seed)
        noise = randn_tensor(self._noise_shape(spec), generator=generator, device=self.device,
                             dtype=self.placement.text_dtype)
        return pack_latents(noise[:, 0]), generator

    def inpainting(self, spec: GenerationSpec, image: torch.Tensor,
                   mask: torch.Tensor) -> QwenInpainting:
        """The image's sample and the noise drawn again from the seed (as ``initial_latents``
        draws them, so a run resumed from a checkpoint has them too), and the mask over the
        latents' channels, all packed as the latents are."""
        start, noise, _ = self._image_start(spec, image)
        channels = self.transformer.config.in_channels // 4
        repaint = mask.to(self.device, self.placement.text_dtype).repeat(1, channels, 1, 1)
        return QwenInpainting(pack_latents(start[:, 0]), pack_latents(noise[:, 0]),
                              pack_latents(repaint))

    def _noise_shape(self, spec: GenerationSpec) -> tuple[int, ...]:
        rows, cols = self.tokens_per_side(spec)
        return (1, 1, self.transformer.config.in_channels // 4, 2 * rows, 2 * cols)

    def _image_start(self, spec: GenerationSpec, image: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Generator]:
        """The input image's normalised sample and the noise, each (1, 1, C, H, W), drawn in
        that order from the seed's generator, as the image pipelines draw them."""
        from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
        from diffusers.utils.torch_utils import randn_tensor

        if spec.image is None or image is None:
            raise ValueError(f"request {spec.request_id} starts from an image, but its "
                             "encoding was not given")
        generator = torch.Generator(device="cpu").manual_seed(spec.seed)
        sample = DiagonalGaussianDistribution(image.to(self.device)).sample(generator)
        mean = self.latents_mean.to(sample.device, sample.dtype)
        scale = 1.0 / self.latents_std.to(sample.device, sample.dtype)
        start = ((sample - mean) * scale).transpose(1, 2)  # (1, 1, C, H, W) as the noise
        noise = randn_tensor(self._noise_shape(spec), generator=generator, device=self.device,
                             dtype=self.placement.text_dtype)
        return start, noise, generator

    def tokens(self, spec: GenerationSpec, condition: tuple[int, ...] | None = None
               ) -> int:
        rows, cols = self.tokens_per_side(spec)
        return rows * cols

    def text_shape(self) -> tuple[int, int]:
        return TYPICAL_PROMPT_TOKENS, self.transformer.config.joint_attention_dim

    def condition_shape(self, spec: GenerationSpec) -> tuple[int, ...] | None:
        return None  # an input image only starts the trajectory (``initial_latents``)

    @torch.no_grad()
    def predict(self, latents: torch.Tensor, t: torch.Tensor, embeds: torch.Tensor,
                spec: GenerationSpec, text_mask: torch.Tensor | None = None,
                condition: torch.Tensor | None = None) -> torch.Tensor:
        check_condition(spec, condition, takes=False)
        timestep = t.expand(latents.shape[0]).to(latents.dtype)
        # In the DiT's dtype: texts encoded elsewhere (an encode pool on CPU) come in float32.
        embeds = embeds.to(self.device, self.transformer.dtype)
        return self.transformer(hidden_states=latents, timestep=timestep / 1000, guidance=None,
                                encoder_hidden_states_mask=text_mask,
                                encoder_hidden_states=embeds,
                                img_shapes=[[(1, *self.tokens_per_side(spec))]]
                                * latents.shape[0],
                                attention_kwargs={}, return_dict=False)[0]

    def step_cache_config(self, cache: StepCache, steps: int) -> Any:
        # TaylorSeer's default patterns match transformer_blocks.N.attn.
        return hook_config(cache, steps, mag_ratios=self.mag_ratios)

    @staticmethod
    def guide(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
        """True CFG, then rescaled per token to the conditional prediction's norm."""
        combined = uncond + scale * (cond - uncond)
        cond_norm = torch.norm(cond, dim=-1, keepdim=True)
        combined_norm = torch.norm(combined, dim=-1, keepdim=True)
        return combined * (cond_norm / combined_norm)


# --- Decode ---------------------------------------------------------------------------------


class QwenDecoder:
    """The Qwen-Image VAE: one image per request."""

    def __init__(self, directory: Path, placement: Placement = CPU) -> None:
        from diffusers import AutoencoderKLQwenImage
        from diffusers.image_processor import VaeImageProcessor

        placement = in_model_dtype(placement)
        self.device = placement.device
        self.vae = AutoencoderKLQwenImage.from_pretrained(
            directory / "vae", dtype=placement.vae_dtype).to(self.device).eval()
        self.scale_factor = 2 ** len(self.vae.temperal_downsample)
        self.processor = VaeImageProcessor(vae_scale_factor=self.scale_factor * 2)
        self.fingerprint = component_fingerprint(directory, "vae", self.vae.dtype, self.device)

    @torch.no_grad()
    def frames(self, latents: torch.Tensor, spec: GenerationSpec) -> Iterator[np.ndarray]:
        vae, config = self.vae, self.vae.config
        f = self.scale_factor * 2
        rows, cols = spec.height // f, spec.width // f
        channels = latents.shape[-1] // 4
        latents = latents.view(1, rows, cols, channels, 2, 2).permute(0, 3, 1, 4, 2, 5)
        latents = latents.reshape(1, channels, 1, 2 * rows, 2 * cols).to(self.device, vae.dtype)
        mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1).to(latents)
        std = 1.0 / torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1).to(latents)
        image = vae.decode(latents / std + mean, return_dict=False)[0][:, :, 0]
        yield to_uint8(self.processor.postprocess(image, output_type="np"))


class QwenReference:
    """The monolithic ``QwenImagePipeline`` (``QwenImageImg2ImgPipeline`` over the same
    components for a request with an input image, ``QwenImageInpaintPipeline`` for one with
    a mask too): what the three stages must equal."""

    def __init__(self, directory: Path, placement: Placement = CPU) -> None:
        from diffusers import QwenImageImg2ImgPipeline, QwenImageInpaintPipeline, QwenImagePipeline

        placement = in_model_dtype(placement)
        self.pipe = placed_pipeline(QwenImagePipeline, directory, placement)
        self.img2img = sibling_pipeline(QwenImageImg2ImgPipeline, self.pipe)
        self.inpaint = sibling_pipeline(QwenImageInpaintPipeline, self.pipe)
        self.mag_ratios = model_card(directory).magcache_ratios

    def __call__(self, spec: GenerationSpec, image: Image.Image | None = None,
                 mask: Image.Image | None = None) -> np.ndarray:
        segment = spec.schedule[0]
        config = (hook_config(spec.step_cache, spec.num_inference_steps,
                              mag_ratios=self.mag_ratios) if spec.step_cache.on else None)
        call: dict[str, Any] = dict(
            negative_prompt=segment.negative_prompt, true_cfg_scale=spec.guidance_scale,
            height=spec.height, width=spec.width, num_inference_steps=spec.num_inference_steps,
            generator=torch.Generator().manual_seed(spec.seed), output_type="np")
        pipe: Any = self.pipe
        if spec.image is not None:
            if image is None or (mask is None) != (spec.image.mask is None):
                raise ValueError(f"request {spec.request_id} starts from an image; give it, "
                                 "and its mask where it has one")
            pipe, call = self.img2img, call | {"image": image, "strength": spec.image.strength}
            if mask is not None:
                pipe, call = self.inpaint, call | {"mask_image": mask}
        with hooks_enabled(pipe.transformer, config):
            images = pipe(segment.prompt, **call).images
        return to_uint8(images)


def geometry(directory: Path) -> ModelGeometry:
    vae, dit = component_config(directory, "vae"), component_config(directory, "transformer")
    # As QwenImagePipeline computes it: one VAE downsampling per temporal-downsample entry.
    return ModelGeometry(spatial_factor=2 ** len(vae["temperal_downsample"]) * dit["patch_size"],
                         frame_factor=1, layers=dit["num_layers"],
                         width=dit["num_attention_heads"] * dit["attention_head_dim"])


# What a request may ask of this family: the text encoder keeps 512 tokens after the template's
# system prefix, which ends in five tokens of its own.
LIMITS = FamilyLimits(video=False, frame_multiple=1, spatial_multiple=16,
                      max_prompt_tokens=507, workflows=frozenset({
                          Workflow.TEXT_TO_IMAGE, Workflow.IMAGE_TO_IMAGE, Workflow.INPAINTING}))


FAMILY = Family(name="qwen-image", pipeline_class="QwenImagePipeline",
                limits=LIMITS, presets=tuple(PRESETS), build=build,
                text_encoder=QwenTextEncoder, trajectory=QwenTrajectory,
                denoiser=QwenDenoiser, decoder=QwenDecoder, reference=QwenReference,
                geometry=geometry, image_encoder=QwenImageEncoder,
                trainable=Trainable(untrained, pack_latents))
