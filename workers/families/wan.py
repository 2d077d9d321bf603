"""The Wan2.1 family: text encoder, DiT and VAE, loaded with ``from_pretrained``.

The embedded default is a tiny Wan2.1-architecture pipeline built from a fixed seed and saved
with ``save_pretrained`` on first start; from then on it loads through the same path a real
checkpoint such as ``Wan-AI/Wan2.1-T2V-1.3B-Diffusers`` takes. The stage code here reproduces
``WanPipeline.__call__`` step for step, which is what makes outputs bit-identical to it.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from keys import Fingerprint, GenerationSpec, StepCache
from workers.families.base import (
    CPU,
    Family,
    Inpainting,
    Placement,
    Tokens,
    check_condition,
    component_config,
    component_fingerprint,
    placed_pipeline,
    to_uint8,
)
from workers.families.scheduler_state import SchedulerFields
from workers.families.step_cache import hook_config, hooks_enabled
from workers.queue.served_model import FamilyLimits, ModelGeometry, Workflow, model_card

MAX_SEQUENCE_LENGTH = 512  # what WanPipeline.__call__ uses (encode_prompt defaults to 226)
PRESET_FILE = "diffcache-preset.json"
SPECIAL_TOKENS = ["<pad>", "</s>", "<unk>"]
PUNCTUATION = list(".,!?;:'\"()-")


@dataclass(frozen=True, slots=True)
class WanPreset:
    """Sizes of the tiny built-in model. ``default`` makes denoise dominate a request's compute,
    as on real video models; ``test`` is the smallest model that exercises every code path."""

    vocab_words: int
    text_dim: int
    text_layers: int
    text_heads: int
    dit_heads: int
    dit_head_dim: int
    dit_ffn: int
    dit_layers: int
    vae_base_dim: int


PRESETS = {
    "default": WanPreset(vocab_words=4000, text_dim=64, text_layers=2, text_heads=4,
                         dit_heads=4, dit_head_dim=32, dit_ffn=512, dit_layers=14,
                         vae_base_dim=8),
    "test": WanPreset(vocab_words=4000, text_dim=32, text_layers=1, text_heads=2,
                      dit_heads=2, dit_head_dim=16, dit_ffn=64, dit_layers=2, vae_base_dim=4),
}


def _word_tokenizer(words: list[str]) -> Any:
    """A lower-casing word-level tokenizer that appends ``</s>``, as T5 tokenizers do."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for word in [*PUNCTUATION, *words]:
        vocab.setdefault(word, len(vocab))
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>",
                                                       special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                                   unk_token="<unk>", model_max_length=MAX_SEQUENCE_LENGTH)


def build(directory: Path, preset_name: str, seed: int = 0) -> None:
    """Build the tiny pipeline from ``seed`` and save it with ``save_pretrained``."""
    from diffusers import WanPipeline

    save_built(directory, components(preset_name, seed).pipeline(WanPipeline), preset_name,
               seed)


@dataclass(frozen=True, slots=True)
class TinyWan:
    """A tiny random Wan model's components, before they are a pipeline."""

    tokenizer: Any
    text_encoder: Any
    transformer: Any
    vae: Any
    scheduler: Any

    def pipeline(self, pipeline_class: Callable[..., Any]) -> Any:
        return pipeline_class(tokenizer=self.tokenizer, text_encoder=self.text_encoder,
                              transformer=self.transformer, vae=self.vae,
                              scheduler=self.scheduler)


def components(preset_name: str, seed: int, condition_channels: int = 0) -> TinyWan:
    """The tiny pipeline's components, built from ``seed``; the DiT takes
    ``condition_channels`` beside its latents' (an image-to-video model's condition)."""
    import wordfreq
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    preset = PRESETS[preset_name]
    torch.manual_seed(seed)
    # Common English words, so real prompts rarely fall back to <unk> (which would merge
    # distinct prompts into one embedding key and inflate hit rates).
    tokenizer = _word_tokenizer(wordfreq.top_n_list("en", preset.vocab_words))
    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=len(tokenizer), d_model=preset.text_dim, d_kv=preset.text_dim // 4,
        d_ff=preset.text_dim * 2, num_layers=preset.text_layers, num_heads=preset.text_heads,
        relative_attention_num_buckets=32, pad_token_id=0, eos_token_id=1,
        decoder_start_token_id=0))
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=preset.dit_heads,
        attention_head_dim=preset.dit_head_dim, in_channels=16 + condition_channels,
        out_channels=16,
        text_dim=preset.text_dim, freq_dim=256, ffn_dim=preset.dit_ffn,
        num_layers=preset.dit_layers, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        rope_max_seq_len=1024)
    vae = AutoencoderKLWan(base_dim=preset.vae_base_dim, z_dim=16, dim_mult=[1, 2, 4, 4],
                           num_res_blocks=1, temperal_downsample=[False, True, True])
    # The scheduler Wan2.1 ships with: UniPC over flow-matching sigmas.
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        flow_shift=3.0, num_train_timesteps=1000)
    return TinyWan(tokenizer, text_encoder, transformer, vae, scheduler)


def save_built(directory: Path, pipe: Any, preset_name: str, seed: int) -> None:
    """Save a built pipeline with ``save_pretrained``, and which preset and seed made it."""
    directory.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(directory)
    (directory / PRESET_FILE).write_text(json.dumps({"preset": preset_name, "seed": seed,
                                                     **asdict(PRESETS[preset_name])}))


# The attention modules TaylorSeer forecasts: diffusers' default patterns must end in "attn",
# and Wan's are attn1 (self) and attn2 (cross).
ATTENTION = (r"blocks\.\d+\.attn1", r"blocks\.\d+\.attn2")

# --- Encode ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WanTokens:
    ids: tuple[int, ...]
    mask: tuple[int, ...]


class WanTextEncoder:
    """UMT5 conditioning exactly as ``WanPipeline._get_t5_prompt_embeds`` computes it."""

    max_length = MAX_SEQUENCE_LENGTH

    def __init__(self, directory: Path, placement: Placement = CPU) -> None:
        from transformers import AutoTokenizer, UMT5EncoderModel

        self.device = placement.device
        self.tokenizer = AutoTokenizer.from_pretrained(directory / "tokenizer")
        model: Any = UMT5EncoderModel.from_pretrained(directory / "text_encoder",
                                                      dtype=placement.text_dtype)
        self.model = model.to(self.device).eval()
        self.fingerprint = component_fingerprint(directory, "text_encoder", self.model.dtype,
                                                 self.device)

    def tokenize(self, text: str) -> WanTokens:
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        out = self.tokenizer([prompt_clean(text)], padding="max_length",
                             max_length=self.max_length, truncation=True,
                             add_special_tokens=True, return_attention_mask=True,
                             return_tensors="pt")
        return WanTokens(tuple(out.input_ids[0].tolist()),
                         tuple(out.attention_mask[0].tolist()))

    @torch.no_grad()
    def encode(self, tokens: Tokens) -> torch.Tensor:
        ids = torch.tensor([list(tokens.ids)], device=self.device)
        mask = torch.tensor([list(tokens.mask)], device=self.device)
        hidden = self.model(ids, mask).last_hidden_state
        # Zero everything past the text, as the pipeline does.
        length = int(mask.gt(0).sum())
        out = torch.zeros_like(hidden)
        out[:, :length] = hidden[:, :length]
        return out

    def text_positions(self, tokens: Tokens, embedding: torch.Tensor) -> int:
        """The embedding's positions that hold the text: those before the zeroed padding."""
        return sum(1 for m in tokens.mask if m)


# --- Denoise --------------------------------------------------------------------------------


class WanTrajectory:
    """What names a trajectory and its output, read from the model's files without loading
    any weights: scheduler config and timesteps, DiT and VAE fingerprints."""

    # UniPC's stepping state: its last model outputs and their timesteps, the last sample, and
    # its order counters (as diffusers 0.42 keeps them; tests/test_scheduler_state.py).
    scheduler_fields = SchedulerFields(histories=("model_outputs", "timestep_list"),
                                       samples=("last_sample",),
                                       counters=("lower_order_nums", "this_order",
                                                 "_step_index"))

    def __init__(self, directory: Path, placement: Placement = CPU) -> None:
        from diffusers import UniPCMultistepScheduler

        self.device = placement.device
        self.mag_ratios = model_card(directory).magcache_ratios
        self.scheduler_config = dict(
            UniPCMultistepScheduler.load_config(directory / "scheduler"))
        self._scheduler_cls = UniPCMultistepScheduler
        self.fingerprint = component_fingerprint(directory, "transformer",
                                                 placement.dit_dtype, self.device,
                                                 placement.dit_split)
        self.decoder_fingerprint = component_fingerprint(directory, "vae", placement.vae_dtype,
                                                         self.device)
        self.image_fingerprint: Fingerprint | None = None  # it takes no input image yet

    def scheduler(self, spec: GenerationSpec) -> Any:
        scheduler = self._scheduler_cls.from_config(self.scheduler_config)
        scheduler.set_timesteps(spec.num_inference_steps, device=self.device)
        scheduler.set_begin_index(0)
        return scheduler


class WanDenoiser(WanTrajectory):
    """The DiT and scheduler, driven one step at a time by the denoise worker."""

    pads_text = False  # every text is padded to MAX_SEQUENCE_LENGTH already, as the pipeline does

    def __init__(self, directory: Path, placement: Placement = CPU) -> None:
        from diffusers import WanTransformer3DModel

        super().__init__(directory, placement)
        self.transformer = WanTransformer3DModel.from_pretrained(
            directory / "transformer", dtype=placement.dit_dtype).to(self.device).eval()
        vae_config = json.loads((directory / "vae" / "config.json").read_text())
        self.temporal_factor = 2 ** sum(vae_config["temperal_downsample"])
        self.spatial_factor = 2 ** (len(vae_config["dim_mult"]) - 1)

    def latent_shape(self, spec: GenerationSpec) -> tuple[int, ...]:
        """(1, channels, latent frames, latent height, latent width) of one video."""
        return (1, self.transformer.config.out_channels,
                (spec.num_frames - 1) // self.temporal_factor + 1,
                spec.height // self.spatial_factor, spec.width // self.spatial_factor)

    def initial_latents(self, spec: GenerationSpec, image: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Generator]:
        """The pipeline's starting noise: ``randn_tensor`` from a CPU generator seeded once,
        then moved to the device, as the pipeline does with a CPU generator.
        The generator comes back too: a stochastic scheduler would draw from it per step, so
        checkpoints carry its state."""
        if spec.image is not None or image is not None:
            raise ValueError(f"request {spec.request_id}: the wan family takes no input image")
        return self._noise(spec)

    def _noise(self, spec: GenerationSpec) -> tuple[torch.Tensor, torch.Generator]:
        from diffusers.utils.torch_utils import randn_tensor

        generator = torch.Generator(device="cpu").manual_seed(spec.seed)
        latents = randn_tensor(self.latent_shape(spec), generator=generator,
                               device=self.device, dtype=torch.float32)
        return latents, generator

    def text_shape(self) -> tuple[int, int]:
        return MAX_SEQUENCE_LENGTH, self.transformer.config.text_dim

    def tokens(self, spec: GenerationSpec, condition: tuple[int, ...] | None = None
               ) -> int:
        _, _, frames, height, width = self.latent_shape(spec)
        pt, ph, pw = self.transformer.config.patch_size
        return (frames // pt) * (height // ph) * (width // pw)

    def condition_shape(self, spec: GenerationSpec) -> tuple[int, ...] | None:
        return None  # text to video

    def inpainting(self, spec: GenerationSpec, image: torch.Tensor,
                   mask: torch.Tensor) -> Inpainting:
        raise ValueError(f"request {spec.request_id}: a Wan model does no inpainting")

    @torch.no_grad()
    def predict(self, latents: torch.Tensor, t: torch.Tensor, embeds: torch.Tensor,
                spec: GenerationSpec, text_mask: torch.Tensor | None = None,
                condition: torch.Tensor | None = None) -> torch.Tensor:
        """One transformer forward: the model's prediction for ``latents`` at timestep ``t``
        (texts are never padded here, so ``text_mask`` is None), with the image ``condition``
        beside the latents' channels where the family takes one (``condition_shape``)."""
        check_condition(spec, condition, takes=self.condition_shape(spec) is not None)
        model_input = (latents if condition is None
                       else torch.cat([latents, condition], dim=1)).to(self.transformer.dtype)
        return self.transformer(hidden_states=model_input, timestep=t.expand(latents.shape[0]),
                                encoder_hidden_states=embeds.to(self.device,
                                                                self.transformer.dtype),
                                return_dict=False)[0]

    def step_cache_config(self, cache: StepCache, steps: int) -> Any:
        return hook_config(cache, steps, ATTENTION, self.mag_ratios)

    @staticmethod
    def guide(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
        """Classifier-free guidance, in the pipeline's exact operation order."""
        return uncond + scale * (cond - uncond)


# --- Decode ---------------------------------------------------------------------------------


class WanDecoder:
    """The Wan VAE, decoding one latent frame at a time so video memory stays bounded."""

    def __init__(self, directory: Path, placement: Placement = CPU) -> None:
        from diffusers import AutoencoderKLWan
        from diffusers.video_processor import VideoProcessor

        self.device = placement.device
        self.vae = AutoencoderKLWan.from_pretrained(
            directory / "vae", dtype=placement.vae_dtype).to(self.device).eval()
        self.processor = VideoProcessor(vae_scale_factor=self.vae.config.scale_factor_spatial)
        self.fingerprint = component_fingerprint(directory, "vae", self.vae.dtype, self.device)

    @torch.no_grad()
    def frames(self, latents: torch.Tensor, spec: GenerationSpec) -> Iterator[np.ndarray]:
        """uint8 frames (F, H, W, 3) chunk by chunk, equal to the pipeline's whole decode.

        This is ``AutoencoderKLWan._decode`` with its frame loop opened up: the causal feature
        cache carries across latent frames, so each chunk comes out exactly as it would inside
        one call, and only one chunk of pixels is held at a time.
        """
        vae = self.vae
        config = vae.config
        latents = latents.to(self.device, vae.dtype)
        mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1).to(latents)
        std = 1.0 / torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1).to(latents)
        z = latents / std + mean
        vae.clear_cache()
        try:
            x = vae.post_quant_conv(z)
            for i in range(z.shape[2]):
                vae._conv_idx = [0]
                chunk = vae.decoder(x[:, :, i:i + 1], feat_cache=vae._feat_map,
                                    feat_idx=vae._conv_idx, first_chunk=(i == 0))
                chunk = torch.clamp(chunk, min=-1.0, max=1.0)
                video = self.processor.postprocess_video(chunk, output_type="np")
                yield to_uint8(video[0])
        finally:
            vae.clear_cache()



class WanReference:
    """The monolithic ``WanPipeline``: what the three stages must equal."""

    def __init__(self, directory: Path, placement: Placement = CPU,
                 pipeline_class: Callable[..., Any] | None = None) -> None:
        from diffusers import WanPipeline

        self.pipe = placed_pipeline(pipeline_class or WanPipeline, directory, placement)
        self.mag_ratios = model_card(directory).magcache_ratios

    def __call__(self, spec: GenerationSpec, image: Image.Image | None = None,
                 mask: Image.Image | None = None) -> np.ndarray:
        """The pipeline's frames for ``spec``; a schedule switches the prompt embeddings at
        each segment's end through the pipeline's step-end callback (guidance stays one)."""
        if spec.image is not None or image is not None or mask is not None:
            raise ValueError(f"request {spec.request_id}: the wan family takes no input image")
        return self._frames(spec, {})

    def _frames(self, spec: GenerationSpec, inputs: dict[str, Any]) -> np.ndarray:
        """The pipeline's frames for ``spec``, given ``inputs`` beside the prompt (an
        image-to-video pipeline's image)."""
        segment = spec.schedule[0]
        if any(spec.guidance_of(s) != spec.guidance_scale for s in spec.schedule):
            raise ValueError("the reference switches prompts, not guidance, mid-schedule")
        config = (hook_config(spec.step_cache, spec.num_inference_steps, ATTENTION,
                              self.mag_ratios) if spec.step_cache.on else None)
        with hooks_enabled(self.pipe.transformer, config):
            frames = self.pipe(prompt=segment.prompt, negative_prompt=segment.negative_prompt,
                               height=spec.height, width=spec.width,
                               num_frames=spec.num_frames,
                               num_inference_steps=spec.num_inference_steps,
                               guidance_scale=spec.guidance_scale,
                               generator=torch.Generator().manual_seed(spec.seed),
                               output_type="np", **inputs, **self._switches(spec)).frames
        return to_uint8(frames[0])

    def _switches(self, spec: GenerationSpec) -> dict[str, Any]:
        after = {s.until_step: nxt for s, nxt in itertools.pairwise(spec.schedule)}
        if not after:
            return {}
        pipe, dtype = self.pipe, self.pipe.transformer.dtype

        def switch(_: object, step: int, t: object, tensors: dict[str, Any]) -> dict[str, Any]:
            segment = after.get(step + 1)
            if segment is None:
                return {}
            # As the pipeline encodes its own prompt (its default length of 512 tokens).
            cond, uncond = pipe.encode_prompt(
                segment.prompt, segment.negative_prompt,
                do_classifier_free_guidance=spec.guidance_scale > 1.0,
                max_sequence_length=512, device=pipe._execution_device)
            out = {"prompt_embeds": cond.to(dtype)}
            if uncond is not None:
                out["negative_prompt_embeds"] = uncond.to(dtype)
            return out

        return {"callback_on_step_end": switch,
                "callback_on_step_end_tensor_inputs": ["prompt_embeds",
                                                       "negative_prompt_embeds"]}


def geometry(directory: Path) -> ModelGeometry:
    vae, dit = component_config(directory, "vae"), component_config(directory, "transformer")
    _, patch_h, _ = dit["patch_size"]  # (frames, height, width)
    return ModelGeometry(spatial_factor=vae["scale_factor_spatial"] * patch_h,
                         frame_factor=vae["scale_factor_temporal"], layers=dit["num_layers"],
                         width=dit["num_attention_heads"] * dit["attention_head_dim"])


# What a request may ask of this family: the text encoder keeps 512 tokens, with the EOS the
# tokenizer appends.
LIMITS = FamilyLimits(video=True, frame_multiple=4, spatial_multiple=16,
                      max_prompt_tokens=511, workflows=frozenset({Workflow.TEXT_TO_VIDEO}))


FAMILY = Family(name="wan", pipeline_class="WanPipeline", limits=LIMITS,
                presets=tuple(PRESETS), build=build, text_encoder=WanTextEncoder,
                trajectory=WanTrajectory, denoiser=WanDenoiser, decoder=WanDecoder,
                reference=WanReference, geometry=geometry)
