"""The lookup log against the real store: every lookup and write of a valued entry is a line,
in order, with its size and cost; hand-offs and entries nothing recomputes are not."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch

from bench.offline_optimum import savings
from cachesvc.connect import open_cache
from cachesvc.lookup_log import Access, read_log
from cachesvc.tensor_cache import TensorCache
from config.settings import Settings
from keys import KeyKind, StoreKey


@pytest.fixture
def logged(stack_settings: Settings, redis_client: redis.Redis,
           tmp_path: Path) -> Iterator[TensorCache]:
    """A cache over an empty store that logs its lookups to ``tmp_path``."""
    settings = stack_settings.model_copy(update={"cache": stack_settings.cache.model_copy(
        update={"lookup_log_dir": tmp_path})})
    cache = open_cache(settings, redis_client)
    cache.store.remove_all()
    yield cache
    cache.close()


def test_every_lookup_and_write_of_a_valued_entry_is_logged(
        logged: TensorCache, tmp_path: Path) -> None:
    key = StoreKey("logged", KeyKind.EMBEDDING, "e")
    latents = StoreKey("logged", KeyKind.LATENTS, "in-flight")
    assert logged.get(key) is None
    logged.put(key, torch.zeros(256), cost_s=0.25)
    assert logged.get(key) is not None
    assert logged.contains(key)
    assert logged.get(key, lookup=False) is not None  # handed on: not a lookup
    logged.put(latents, torch.zeros(256), cost_s=1.0)  # in flight: never valued
    assert logged.get(latents) is not None
    log = read_log(tmp_path)
    assert [(a.access, a.key) for a in log] == [
        (Access.MISS, str(key)), (Access.WRITE, str(key)), (Access.HIT, str(key)),
        (Access.HIT, str(key))]
    write, hit = log[1], log[2]
    assert write.size > 256 * 4 and write.cost_s == hit.cost_s == 0.25
    assert savings(log, write.size).saved_s == 0.5
    assert savings(log, write.size).bound_s == pytest.approx(0.5)
    assert savings(log, write.size - 1).bound_s < 0.5  # a node too small for it keeps part


def test_a_computed_miss_is_logged_before_the_write_it_leads_to(
        logged: TensorCache, tmp_path: Path) -> None:
    key = StoreKey("logged", KeyKind.EMBEDDING, "computed")
    logged.get_or_compute(key, lambda: torch.ones(256))
    logged.get_or_compute(key, lambda: torch.ones(256))
    # Logged after its write, the miss would read as a lookup a cache could have served.
    assert [a.access for a in read_log(tmp_path)] == [Access.MISS, Access.WRITE, Access.HIT]


def test_a_search_of_several_keys_is_one_group_and_a_closed_log_fails_nothing(
        logged: TensorCache, tmp_path: Path) -> None:
    chain = [StoreKey("logged", KeyKind.CHECKPOINT, f"{step}-c") for step in (1, 2)]
    logged.log_missed(chain)
    logged.log_missed(chain[:1])
    groups = [a.group for a in read_log(tmp_path)]
    assert groups[0] == groups[1] != groups[2] and None not in groups
    assert logged.lookups is not None
    logged.lookups.close()
    assert logged.get(chain[0]) is None  # a lookup still answers once its log is gone
