"""Seconds and memory of work that may run on a GPU. CUDA queues kernels and returns at once,
so a clock read right after a forward measures its launch: every timed span here waits for its
device first, and the engine's layout choice, its compute-saved figures and its stage metrics
time the arithmetic itself."""

from __future__ import annotations

import gc
import time

import torch


def settle(device: torch.device) -> None:
    """Wait until the work queued on ``device`` is done (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds_since(start: float, device: torch.device) -> float:
    """The seconds from ``start`` (``time.perf_counter()``) until ``device`` is done."""
    settle(device)
    return time.perf_counter() - start


def release_memory(device: torch.device) -> None:
    """After an out-of-memory error: what the failed work held goes back to the device, so
    the work retried next finds it (the caching allocator keeps freed blocks otherwise)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
