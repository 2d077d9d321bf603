"""Rows of every step-cache policy and adapter set in one forward, each bit for bit what
diffusers computes for it alone (its cache hooks, peft's adapters), and pins of the diffusers
identifiers the engine reads (private to diffusers 0.42). CPU, float32, one thread per op."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.lora import random_lora
from keys import StepCache, StepCachePolicy
from tests.workers_harness import make_spec
from workers.engine.exact_rows import pad_texts, rows_apart
from workers.engine.forward_rows import Forward, RowAdapters, running
from workers.engine.hook_state import CachedForward
from workers.engine.row_adapters import AdapterRows
from workers.engine.row_caches import RowCaches
from workers.engine.transformer_blocks import attention_of, blocks_of, outputs_of
from workers.families import qwen_image, wan
from workers.families.base import CPU
from workers.families.step_cache import hooks_enabled

STEPS = 10
# Ratios that let MagCache skip within ten steps (a tiny model's own would rarely let it).
RATIOS = (1.0, 1.02, 0.99, 0.98, 0.97, 0.97, 0.96, 0.95, 0.95, 0.94)
POLICIES = (StepCache.create(StepCachePolicy.FIRST_BLOCK, threshold=0.3),
            StepCache.create(StepCachePolicy.MAGCACHE, threshold=0.5, max_skip=3),
            StepCache.create(StepCachePolicy.TAYLORSEER, interval=2, warmup=2, max_order=1),
            StepCache())


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def denoiser(family: str, model_dir: Path, qwen_model_dir: Path) -> Any:
    if family == "wan":
        model: Any = wan.WanDenoiser(model_dir, CPU)
    else:
        model = qwen_image.QwenDenoiser(qwen_model_dir, CPU)
    model.mag_ratios = RATIOS
    return model


def text_width(model: Any) -> int:
    config = model.transformer.config
    return int(config.text_dim if "text_dim" in config else config.joint_attention_dim)


@pytest.mark.parametrize(("family", "lengths"), [
    ("wan", (7, 7, 7, 7)),
    ("qwen-image", (7, 7, 7, 7)),
    ("qwen-image", (5, 11, 7, 9)),  # texts padded to a common length under a key mask
])
def test_each_row_takes_its_own_step_cache_decisions_as_its_hooks_alone(
        family: str, lengths: tuple[int, ...], model_dir: Path, qwen_model_dir: Path) -> None:
    """Four rows, one per policy and one without, over ten steps of slowly moving latents:
    every output of the shared forward equals the row's own run under
    ``transformer.enable_cache(<its config>)``, and the caches did skip work."""
    spec = make_spec(width=32, height=32, num_frames=5 if family == "wan" else 1)
    reference_model = denoiser(family, model_dir, qwen_model_dir)
    g = torch.Generator().manual_seed(0)
    shape = reference_model.latent_shape(spec)
    start = [torch.randn(shape, generator=g) for _ in POLICIES]
    drift = [0.02 * torch.randn(shape, generator=g) for _ in POLICIES]
    embeds = [torch.randn(1, n, text_width(reference_model), generator=g) for n in lengths]
    timesteps = torch.linspace(999, 50, STEPS)

    def latents(row: int, step: int) -> torch.Tensor:
        return start[row] + step * drift[row]

    alone = []
    for i, policy in enumerate(POLICIES):
        config = reference_model.step_cache_config(policy, STEPS) if policy.on else None
        outputs = []
        with hooks_enabled(reference_model.transformer, config), torch.no_grad():
            for k in range(STEPS):
                if config is None:
                    outputs.append(reference_model.predict(latents(i, k), timesteps[k:k + 1],
                                                           embeds[i], spec))
                    continue
                with reference_model.transformer.cache_context("cond"):
                    outputs.append(reference_model.predict(latents(i, k), timesteps[k:k + 1],
                                                           embeds[i], spec))
        alone.append(outputs)

    model = denoiser(family, model_dir, qwen_model_dir)
    caches = RowCaches(model.transformer, model.step_cache_config)
    states: list[Any] = [() for _ in POLICIES]
    skipped = [0] * len(POLICIES)
    text, mask = pad_texts(embeds)
    for k in range(STEPS):
        slots = [CachedForward(p, STEPS, states[i]) if p.on else None
                 for i, p in enumerate(POLICIES)]
        rows = [None if slot is None else caches.row(slot) for slot in slots]
        with rows_apart(mask) as mode, running(Forward(rows, [()] * len(rows), mode)):
            out = model.predict(torch.cat([latents(i, k) for i in range(len(POLICIES))]),
                                timesteps[k].expand(len(POLICIES)), text, spec, mask)
        for i, (slot, row) in enumerate(zip(slots, rows, strict=True)):
            if slot is not None and row is not None:
                RowCaches.settle(slot, row)
                states[i], skipped[i] = slot.after, skipped[i] + slot.skipped
            assert torch.equal(out[i:i + 1], alone[i][k]), (
                f"step {k}, row {i} ({POLICIES[i].policy.value})")
    first_block, magcache, taylorseer, _ = skipped
    assert first_block > 0 and magcache > 0 and taylorseer > 0, skipped


def test_each_row_runs_its_own_adapters_as_peft_alone(model_dir: Path) -> None:
    """Rows of no adapter, one, two mixed with their scales, and one at another scale (one
    adapter also on a layer the others leave alone) in one forward: each equals the model
    with peft's ``set_adapters`` of that set, alone."""
    spec = make_spec(width=32, height=32, num_frames=5)
    loras = {n: random_lora(model_dir, seed=n, targets=(
        ("attn1.to_q", "attn1.to_v", "ffn.net.0.proj") if n == 2 else ("attn1.to_q", "attn1.to_v")
    )) for n in (1, 2, 3)}
    sets: list[RowAdapters] = [(), (("a1", 0.7),), (("a2", 1.0), ("a3", 0.5)), (("a3", 0.3),)]

    def loaded() -> Any:
        model = wan.WanDenoiser(model_dir, CPU)
        for n, state in loras.items():
            model.transformer.load_lora_adapter(state, adapter_name=f"a{n}",
                                                prefix="transformer")
        return model

    g = torch.Generator().manual_seed(0)
    reference_model = loaded()
    shape, width = reference_model.latent_shape(spec), text_width(reference_model)
    latents = [torch.randn(shape, generator=g) for _ in sets]
    embeds = [torch.randn(1, 9, width, generator=g) for _ in sets]
    timesteps = torch.tensor([900.0, 700.0, 500.0, 300.0])
    alone = []
    for i, adapters in enumerate(sets):
        if adapters:
            reference_model.transformer.enable_lora()
            reference_model.transformer.set_adapters([name for name, _ in adapters],
                                                     [scale for _, scale in adapters])
        else:
            reference_model.transformer.disable_lora()
        alone.append(reference_model.predict(latents[i], timesteps[i:i + 1], embeds[i], spec))

    model = loaded()
    AdapterRows(model.transformer).hook_new_layers()
    with rows_apart() as mode, running(Forward([None] * len(sets), sets, mode)):
        out = model.predict(torch.cat(latents), timesteps, torch.cat(embeds), spec)
    for i, adapters in enumerate(sets):
        assert torch.equal(out[i:i + 1], alone[i]), f"row {i}: {adapters}"
    assert not torch.equal(alone[1], alone[0])  # the adapters do change the output


@pytest.mark.parametrize(("family", "outputs", "attention"), [
    ("wan", (0, None), ["blocks.0.attn1", "blocks.0.attn2", "blocks.1.attn1", "blocks.1.attn2"]),
    ("qwen-image", (1, 0), ["transformer_blocks.0.attn", "transformer_blocks.1.attn"]),
])
def test_the_diffusers_identifiers_the_engine_reads_are_there(
        family: str, outputs: tuple[int | None, int | None], attention: list[str],
        model_dir: Path, qwen_model_dir: Path) -> None:
    """``transformer_blocks`` reads diffusers' private block registry and identifier
    patterns; a diffusers release that moves them fails here, not in a forward."""
    model = denoiser(family, model_dir, qwen_model_dir)
    blocks = blocks_of(model.transformer)
    assert len(blocks) == model.transformer.config.num_layers
    where = outputs_of(blocks[0])
    assert (where.hidden, where.text) == outputs
    taylor = model.step_cache_config(StepCache.create(StepCachePolicy.TAYLORSEER), STEPS)
    assert [name for name, _ in attention_of(model.transformer, taylor.cache_identifiers)
            ] == attention
