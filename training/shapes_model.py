"""Train the shapes model: the classes of the family its preset belongs to (its VAE, its DiT,
a frozen random text encoder, each as ``model_index.json`` names it) on the synthetic scenes,
then save a normal diffusers folder. The family says how (``Family.trainable``).

Two phases: the VAE learns to reconstruct scenes, then the DiT learns flow matching on the
VAE's normalised latents, conditioned on the frozen encoder's embeddings of the captions
(dropped for a tenth of samples, so CFG has an unconditional branch to work with). Both
learning rates warm up, then decay on a cosine.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from training import checkpoint
from training.checkpoint import PlanError, Position, check_plan
from training.phases import Budget, Phase, Run, warmup_cosine
from training.scenes import RESOLUTION, Scene, scene_at, to_tensor, training_caption, vocabulary
from workers.families import preset_family
from workers.families.base import CPU, Trainable
from workers.queue.served_model import MODEL_CARD, ModelCard, RequestDefaults

# What a request to the trained model gets for the fields it leaves out: the size it learned,
# and the guidance the classifier read best at (2 to 5 tried, on scenes of dataset seed 600,
# which neither training nor bench.quality uses).
SHAPES_DEFAULTS = RequestDefaults(width=RESOLUTION, height=RESOLUTION, num_frames=1,
                                  num_inference_steps=20, guidance_scale=4.0)
# Trained at 32x32 only: past 8x that a request costs minutes of CPU for a picture the model
# never learnt to draw, so the card refuses it (api.enforce_model_max).
SHAPES_CARD = ModelCard(
    native_width=RESOLUTION, native_height=RESOLUTION, max_width=8 * RESOLUTION,
    max_height=8 * RESOLUTION,
    prompts="one coloured circle, square or triangle on a plain background, as in \"a small "
            "red circle on the left on a blue background\"; size and position are optional",
    vocabulary=vocabulary())

# The family the shapes preset is built as, which says how to train one of its models.
FAMILY = preset_family("shapes")
if FAMILY.trainable is None:
    raise RuntimeError(f"the {FAMILY.name} family says nothing of training (Family.trainable)")
TRAINING: Trainable = FAMILY.trainable


def component_class(directory: Path, component: str) -> Any:
    """The diffusers class the folder's ``model_index.json`` names for ``component``."""
    import diffusers

    _, class_name = json.loads((directory / "model_index.json").read_text())[component]
    return getattr(diffusers, class_name)


@dataclass(frozen=True, slots=True)
class TrainPlan:
    """Everything that decides the weights a run ends with."""

    seed: int = 0
    architecture: str = "shapes"  # a preset of the shapes model's family
    vae_steps: int = 1000
    vae_batch: int = 16
    vae_lr: float = 2e-3
    kl_weight: float = 1e-6
    dit_steps: int = 6600
    dit_batch: int = 64
    dit_lr: float = 1e-3
    uncond_share: float = 0.1  # captions replaced by "" (the default negative prompt)

    def __post_init__(self) -> None:
        if self.architecture not in FAMILY.presets:
            raise PlanError(f"architecture must be one of {sorted(FAMILY.presets)}, "
                            f"not {self.architecture!r}")


def write_untrained(plan: TrainPlan, directory: Path) -> None:
    """The starting pipeline. Its text encoder is stored in float16 and trained against in
    that precision, so shipping every component in float16 changes no embedding."""
    pipe = TRAINING.untrained(plan.architecture, plan.seed)
    pipe.text_encoder.half()
    # The posterior starts with a std of 1, which drowns the latents in noise; with a KL this
    # small, Adam would take thousands of steps to shrink it. Starting at e^-3 (measured:
    # +2 dB of reconstruction and every colour right after 450 steps) leaves the steps to
    # the reconstruction.
    with torch.no_grad():
        pipe.vae.quant_conv.bias[pipe.vae.config.z_dim:] = -6.0
    pipe.save_pretrained(directory)


class ShapesTraining:
    """The models, the frozen encoder and the two losses of one run."""

    def __init__(self, plan: TrainPlan, untrained: Path) -> None:
        self.plan = plan
        self.text: Any = FAMILY.text_encoder(untrained, CPU)
        self.vae: Any = component_class(untrained, "vae").from_pretrained(
            untrained / "vae", dtype=torch.float32).train()
        self.transformer: Any = component_class(untrained, "transformer").from_pretrained(
            untrained / "transformer", dtype=torch.float32).train()
        self.generator = torch.Generator().manual_seed(plan.seed)
        self.embeddings: dict[str, torch.Tensor] = {}
        self.scene_latents: dict[Scene, torch.Tensor] = {}
        self.latent_side = RESOLUTION // 2 ** (len(self.vae.temperal_downsample))
        self.mean = torch.zeros(1)
        self.std = torch.ones(1)

    def images(self, dataset_seed: int, step: int, batch: int) -> torch.Tensor:
        scenes = [scene_at(dataset_seed, step * batch + i) for i in range(batch)]
        return to_tensor([scene.render() for scene in scenes]).unsqueeze(2)  # a 1-frame video

    def vae_loss(self, step: int) -> torch.Tensor:
        x = self.images(self.plan.seed, step, self.plan.vae_batch)
        posterior = self.vae.encode(x).latent_dist
        recon = self.vae.decode(posterior.sample(generator=self.generator)).sample
        # L1: sharper edges than MSE in the same steps (measured: 5 more points of shape
        # accuracy through the VAE alone).
        return (recon - x).abs().mean() + self.plan.kl_weight * posterior.kl().mean()

    @torch.no_grad()
    def raw_latent(self, scene: Scene) -> torch.Tensor:
        """A scene's posterior mean, encoded alone: a batch of one gives the same bits
        whichever scenes a step happens to share with, so a resumed run sees the same
        latents. The dataset has about 15,000 distinct scenes, each encoded once."""
        if scene not in self.scene_latents:
            x = to_tensor([scene.render()]).unsqueeze(2)
            self.scene_latents[scene] = self.vae.encode(x).latent_dist.mode()[0, :, 0]
        return self.scene_latents[scene]

    def latents(self, scenes: list[Scene]) -> torch.Tensor:
        """Scenes to the DiT's packed latents: normalised per channel, then packed into 2x2
        patches exactly as the pipeline packs its noise."""
        z = torch.stack([self.raw_latent(scene) for scene in scenes])
        return TRAINING.pack_latents(
            (z - self.mean.view(1, -1, 1, 1)) / self.std.view(1, -1, 1, 1))

    def measure_latents(self, scenes: int = 1024) -> dict[str, list[float]]:
        """Per-channel mean and std of the trained VAE's latents, for the VAE's config."""
        self.vae.eval()
        z = torch.stack([self.raw_latent(scene_at(self.plan.seed + 2, i))
                         for i in range(scenes)])
        return {"latents_mean": z.mean(dim=(0, 2, 3)).tolist(),
                "latents_std": z.std(dim=(0, 2, 3)).tolist()}

    def use_latent_stats(self, stats: dict[str, Any]) -> None:
        self.vae.eval()
        self.mean = torch.tensor(stats["latents_mean"])
        self.std = torch.tensor(stats["latents_std"])

    def embed(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """The captions' embeddings, padded to the longest, and the mask of real tokens."""
        for caption in captions:
            if caption not in self.embeddings:
                self.embeddings[caption] = self.text.encode(self.text.tokenize(caption))[0]
        found = [self.embeddings[c] for c in captions]
        longest = max(e.shape[0] for e in found)
        embeds = torch.zeros(len(found), longest, found[0].shape[-1])
        mask = torch.zeros(len(found), longest, dtype=torch.bool)
        for i, e in enumerate(found):
            embeds[i, :e.shape[0]], mask[i, :e.shape[0]] = e, True
        return embeds, mask

    def dit_loss(self, step: int) -> torch.Tensor:
        """Flow matching as the pipeline's Euler steps read it: at sigma, the input is
        (1 - sigma) x0 + sigma noise and the DiT predicts noise - x0."""
        plan, batch = self.plan, self.plan.dit_batch
        first = step * batch
        scenes = [scene_at(plan.seed + 1, first + i) for i in range(batch)]
        x0 = self.latents(scenes)
        dropped = torch.rand(batch, generator=self.generator) < plan.uncond_share
        captions = ["" if dropped[i] else training_caption(scene, plan.seed + 1, first + i)
                    for i, scene in enumerate(scenes)]
        embeds, mask = self.embed(captions)
        noise = torch.randn(x0.shape, generator=self.generator)
        sigma = torch.sigmoid(torch.randn(batch, generator=self.generator))  # logit-normal
        s = sigma.view(-1, 1, 1)
        side = self.latent_side // 2
        predicted = self.transformer(
            hidden_states=(1 - s) * x0 + s * noise, timestep=sigma, guidance=None,
            encoder_hidden_states=embeds, encoder_hidden_states_mask=mask,
            img_shapes=[[(1, side, side)]] * batch, return_dict=False)[0]
        return torch.nn.functional.mse_loss(predicted, noise - x0)


def train(plan: TrainPlan, out: Path, work: Path, budget: Budget,
          show_progress: bool = True) -> bool:
    """Run (or resume) training in ``work``; True once the model is written to ``out``,
    False when the budget stopped the run first (run again to continue)."""
    check_plan(plan, work)
    untrained = work / "untrained"
    if not (untrained / "model_index.json").exists():
        write_untrained(plan, untrained)
    model = ShapesTraining(plan, untrained)
    run = Run(work / "checkpoint", {"vae": model.vae, "transformer": model.transformer},
              model.generator, budget, show_progress)
    position = checkpoint.read_position(run.directory) or Position("vae", 0, {})
    vae_optimizer = torch.optim.AdamW(model.vae.parameters(), lr=plan.vae_lr)
    dit_optimizer = torch.optim.AdamW(model.transformer.parameters(), lr=plan.dit_lr)
    if run.directory.exists():
        checkpoint.restore(run.directory, run.modules, {
            "vae": vae_optimizer, "dit": dit_optimizer}.get(position.phase), model.generator)
    if position.phase == "vae":
        vae = Phase("vae", plan.vae_steps, vae_optimizer, model.vae_loss,
                    warmup_cosine(plan.vae_lr, plan.vae_steps))
        if not run.step_through(vae, position.step, position.extra):
            return False
        position = Position("dit", 0, model.measure_latents())
        run.save(position, dit_optimizer)
    model.use_latent_stats(position.extra)
    if position.phase == "dit":
        dit = Phase("dit", plan.dit_steps, dit_optimizer, model.dit_loss,
                    warmup_cosine(plan.dit_lr, plan.dit_steps))
        if not run.step_through(dit, position.step, position.extra):
            return False
        position = Position("done", plan.dit_steps, position.extra)
        run.save(position, dit_optimizer)
    write_model(model, untrained, out, position.extra)
    return True


def write_model(model: ShapesTraining, untrained: Path, out: Path,
                stats: dict[str, Any]) -> None:
    """The trained components in the untrained pipeline, every weight in float16 (the
    project ships at most 20 MB), saved with ``save_pretrained``."""
    from diffusers import DiffusionPipeline

    pipe: Any = DiffusionPipeline.from_pretrained(untrained, dtype=torch.float16)
    pipe.vae.load_state_dict(model.vae.state_dict())
    pipe.vae.register_to_config(**stats)
    pipe.transformer.load_state_dict(model.transformer.state_dict())
    out.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(out)
    (out / MODEL_CARD).write_text(json.dumps({"request_defaults": asdict(SHAPES_DEFAULTS),
                                        "model": asdict(SHAPES_CARD),
                                        "training": asdict(model.plan)}, indent=1) + "\n")
