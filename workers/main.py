"""Start one stage worker from the settings object: load its model, connect, run the loop."""

from __future__ import annotations

import atexit
import functools
import logging
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import torch

from cachesvc.connect import open_cache
from cachesvc.output_files import OutputFiles
from cachesvc.redis_client import RedisClient, open_redis
from cachesvc.tensor_cache import TensorCache
from config.settings import Settings
from supervision.supervisor import EXIT_CANNOT_FIT
from workers.families import is_built, resolve
from workers.families.base import Family, Placement, TextEncoder, Trajectory, tokenizer_json
from workers.parallel.layout import ParallelLayout
from workers.queue.affinity import AdapterRouter
from workers.queue.credits import Credits
from workers.queue.messages import Stage
from workers.queue.metrics.adapters import WorkerAdapters, publish_adapter_stats
from workers.queue.preemption import InteractiveWaiting
from workers.queue.runtime import StageHandler, StageWorker, Worker, consumer_name
from workers.queue.served_model import (
    ServedModel,
    model_card,
    publish_lora_targets,
    publish_served,
    request_defaults,
)

if TYPE_CHECKING:
    from workers.stages.approximate import ApproximateReuse

log = logging.getLogger(__name__)

PRESET_FILE = "diffcache-preset"  # in a folder built from a preset: its name


def ensure_model(settings: Settings) -> Family:
    """The family to serve; its built-in model (the trained one, or a tiny random one) is
    installed on first start, later starts load what was saved (or the real checkpoint
    ``model.dir`` names)."""
    family = resolve(settings.model.family, settings.model_dir, settings.model.preset)
    if not is_built(settings.model_dir):
        log.info("building the %s %s model in %s", settings.model.preset, family.name,
                 settings.model_dir)
        build_model(settings, family)
    return family


def build_model(settings: Settings, family: Family) -> None:
    """Build the preset's model in ``model.dir``, saying in it which preset it was."""
    family.build(settings.model_dir, settings.model.preset, settings.model.build_seed)
    (settings.model_dir / PRESET_FILE).write_text(settings.model.preset)


def model_name(settings: Settings) -> str:
    """What clients call the served model: ``model.name``; else, for the built-in folder
    (``<data_dir>/model``), the preset it was built from (a later change of the setting does
    not rebuild it); else the folder's name."""
    if settings.model.name is not None:
        return settings.model.name
    folder = settings.model_dir.resolve()
    if folder != settings.built_in_model_dir.resolve():
        return folder.name
    built = folder / PRESET_FILE
    return built.read_text().strip() if built.is_file() else settings.model.preset


def publish_model(client: RedisClient, settings: Settings, family: Family) -> None:
    """Say which model this deployment serves (its defaults, geometry, card and tokenizer):
    admission checks every request against it, wherever it runs."""
    directory = settings.model_dir
    layout = ParallelLayout.of(settings.workers.denoise_parallel)
    publish_served(client, ServedModel(family.name, model_name(settings), family.limits,
                                       request_defaults(settings.model, directory),
                                       family.geometry(directory), model_card(directory),
                                       denoise_ranks=layout.ranks,
                                       token_parts=layout.token_parts),
                   tokenizer_json(directory))


def build_worker(stage: Stage, settings: Settings) -> tuple[StageWorker, StageHandler]:
    family = resolve(settings.model.family, settings.model_dir, settings.model.preset)
    layout = ParallelLayout.of(settings.workers.denoise_parallel)
    placement = Placement.for_settings(
        settings.model.device, settings.model.dtype, settings.model.encode_device,
        computes="encoders" if stage is Stage.ENCODE else "serving", dit_split=layout.name)
    here = placement.encoding.device if stage is Stage.ENCODE else placement.device
    if here.type == "cuda":
        # Before anything touches CUDA: pinned buffers and the default stream then belong to
        # this worker's own device, not to device 0.
        torch.cuda.set_device(here)
    threads = {Stage.ENCODE: settings.workers.encode_threads,
               Stage.DENOISE: settings.workers.denoise_threads,
               Stage.DECODE: settings.workers.decode_threads}[stage]
    if threads:
        torch.set_num_threads(threads)
    client = open_redis(settings)
    cache = open_cache(settings, client)
    publish_model(client, settings, family)
    directory = settings.model_dir
    files = (OutputFiles(settings.outputs_dir, settings.cache.output_ttl_s)
             if settings.cache.durable_outputs else None)
    if stage is Stage.ENCODE:
        from encoders.text import ImageTextModel
        from workers.stages.encode import EncodeHandler

        # Keys name the serving placement (denoise and decode), wherever this worker encodes.
        trajectory = family.trajectory(directory, placement)
        encoding = placement.encoding
        text = family.text_encoder(directory, encoding)
        reuse = (None if isinstance(text, ImageTextModel)
                 else approximate_reuse(client, cache, family, directory, encoding, text,
                                        trajectory))
        image_encoder = family.image_encoder
        # Loaded once, by the first request with an image: most requests have none.
        images = (None if image_encoder is None
                  else functools.cache(lambda: image_encoder(directory, encoding)))
        encode = EncodeHandler(cache, text, trajectory,
                               files, reuse, images)
        router = (AdapterRouter(client, settings.workers.idle_timeout_s)
                  if settings.workers.adapter_routing else None)
        return Worker(encode, client, settings.workers, router=router), encode
    credits = Credits(client, settings.workers.credit_limit)
    if stage is Stage.DENOISE:
        from workers.parallel.group import start_group
        from workers.stages.adapters import AdapterStats
        from workers.stages.denoise import DenoiseHandler, default_spec
        from workers.stages.denoise_worker import EngineWorker

        defaults = request_defaults(settings.model, directory)
        group = None
        if layout.ranks == 1:
            denoiser = family.denoiser(directory, placement)
        else:
            spec = default_spec(defaults, family.limits)
            denoiser, group = start_group(
                settings, placement, lambda here: family.denoiser(directory, here),
                lambda loaded: layout.check(loaded.transformer, loaded.tokens(spec)))
            atexit.register(group.stop)  # before multiprocessing ends the ranks it started
        consumer = consumer_name()

        def report(stats: AdapterStats, held: tuple[str, ...]) -> None:
            publish_adapter_stats(client, WorkerAdapters(
                consumer, stats.loads, stats.swaps, stats.load_seconds, held,
                tuple(lora.hash for lora in stats.active)))

        kept = (OutputFiles(settings.checkpoints_dir, settings.cache.checkpoint_ttl_s)
                if settings.cache.durable_outputs else None)
        denoise = DenoiseHandler(cache, denoiser, settings.workers, credits, report, kept,
                                 None if group is None else group.forwards)
        denoise.warm_up(defaults, family.limits)
        publish_lora_targets(client, {
            name: (m.out_features, m.in_features)
            for name, m in denoiser.transformer.named_modules()
            if isinstance(m, torch.nn.Linear)})
        waiting = InteractiveWaiting(client, stage, settings.workers)
        return EngineWorker(denoise, client, settings.workers,
                            preemption=waiting.check_for if settings.workers.preempt else None,
                            inbox=settings.workers.adapter_routing), denoise
    from workers.stages.decode import DecodeHandler

    decode = DecodeHandler(cache, family.decoder(directory, placement), settings.workers.fps,
                           credits, files)
    return Worker(decode, client, settings.workers, after_publish=decode.after_publish), decode


def approximate_reuse(client: RedisClient, cache: TensorCache, family: Family,
                      directory: Path, encoding: Placement, text: TextEncoder,
                      trajectory: Trajectory) -> ApproximateReuse:
    """The encode stage's approximate reuse, as the model card says: its vector, its table,
    and the check that a reused step is not too late to switch prompts."""
    from cachesvc.reuse_index import ReuseIndex
    from encoders.text import encode_texts
    from workers.queue.records import Records
    from workers.stages.approximate import Agreement, ApproximateReuse, ReuseTable
    from workers.stages.prompt_view import PromptEffect, prompt_view

    card = model_card(directory)
    denoiser = functools.cache(lambda: family.denoiser(directory, encoding))  # loaded once

    def blank() -> torch.Tensor:
        return text.encode(text.tokenize(""))

    view = prompt_view(card.reuse_vector, denoiser, blank)
    agreement = None
    if card.reuse_agreement is not None:

        def embed(tenant: str, prompt: str) -> torch.Tensor:
            return encode_texts(cache, text, tenant, [prompt])[prompt].tensor

        effect = view if isinstance(view, PromptEffect) else PromptEffect(denoiser(), blank)
        agreement = Agreement(effect, card.reuse_agreement, embed)
    return ApproximateReuse(ReuseIndex(client), Records(client), cache, trajectory,
                            ReuseTable(card.reuse_table), view, agreement)


def run(stage: Stage, settings: Settings) -> None:
    """Run a worker until SIGTERM or SIGINT: it takes no new job, a denoise job checkpoints
    and is re-queued, any other job finishes first."""
    try:
        worker, _ = build_worker(stage, settings)
    except torch.OutOfMemoryError:
        log.exception("%s worker: out of device memory loading the model", stage.value)
        sys.exit(EXIT_CANNOT_FIT)  # a restart would fail alike: the supervisor holds it

    # Only sets the event: a handler that wrote a log line could interrupt another write to
    # the same stream, which fails.
    def stop(_signum: int, _frame: FrameType | None) -> None:
        worker.stop.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    worker.run()
    log.info("%s worker stopped", stage.value)
