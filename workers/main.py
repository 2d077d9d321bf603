"""Start one stage worker from the settings object: load its model, connect, run the loop."""

from __future__ import annotations

import logging
import signal
from types import FrameType

import torch

from cachesvc.connect import open_cache, open_redis
from cachesvc.output_files import OutputFiles
from cachesvc.settings import Settings
from workers.credits import Credits
from workers.messages import Stage
from workers.preemption import InteractiveWaiting
from workers.runtime import Handler, Worker, consumer_name

log = logging.getLogger(__name__)


def ensure_model(settings: Settings) -> None:
    """Build the embedded model on first start; later starts load what was saved."""
    from workers.families import wan

    if not wan.is_built(settings.model_dir):
        log.info("building the %s model in %s", settings.model.preset, settings.model_dir)
        wan.build(settings.model_dir, settings.model.preset, settings.model.build_seed)


def build_worker(stage: Stage, settings: Settings) -> tuple[Worker, Handler]:
    from workers.families import wan

    threads = {Stage.ENCODE: settings.workers.encode_threads,
               Stage.DENOISE: settings.workers.denoise_threads,
               Stage.DECODE: settings.workers.decode_threads}[stage]
    if threads:
        torch.set_num_threads(threads)
    client = open_redis(settings)
    cache = open_cache(settings, client)
    directory = settings.model_dir
    handler: Handler
    if stage is Stage.ENCODE:
        from workers.encode import EncodeHandler

        handler = EncodeHandler(cache, wan.WanTextEncoder(directory),
                                wan.WanTrajectory(directory))
        return Worker(handler, client, settings.workers), handler
    credits = Credits(client, settings.workers.decode_credits)
    if stage is Stage.DENOISE:
        from workers.denoise import DenoiseHandler

        handler = DenoiseHandler(cache, wan.WanDenoiser(directory), settings.workers, credits)
        waiting = InteractiveWaiting(client, stage, consumer_name(), settings.workers)
        return Worker(handler, client, settings.workers,
                      preemption=waiting.check_for if settings.workers.preempt else None), handler
    from workers.decode import DecodeHandler

    files = (OutputFiles(settings.outputs_dir, settings.cache.output_ttl_s)
             if settings.cache.durable_outputs else None)
    decode = DecodeHandler(cache, wan.WanDecoder(directory), settings.workers.fps, credits,
                           files)
    return Worker(decode, client, settings.workers, after_publish=decode.after_publish), decode


def run(stage: Stage, settings: Settings) -> None:
    """Run a worker until SIGTERM or SIGINT; the job in hand finishes first."""
    worker, _ = build_worker(stage, settings)

    def stop(signum: int, _frame: FrameType | None) -> None:
        log.info("%s: stopping after the current job", signal.Signals(signum).name)
        worker.stop.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    worker.run()
