"""Step caching in the engine: diffusers' cache hooks driven one forward at a time. Each run
holds its own hook state per guidance branch; the state goes into the hooks for that run's
forward and comes back out after it, so a step abandoned half-way leaves the run's state as it
was, and a checkpoint can carry the state. Runs share a forward only where their decisions are
bound to be equal: their states are then joined along the batch and split after.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast

import torch
from diffusers.hooks.hooks import StateManager
from diffusers.models.cache_utils import CacheMixin

from keys import StepCache, StepCachePolicy
from workers.stages.guidance import Row
from workers.stages.hook_state import CachedForward, HookFields, HookStateError, RunHookState

BRANCHES = ("cond", "uncond")  # a plan's rows, in order
_CONTEXT = "diffcache"  # the one context the hooks see: the run's state is put in it
# Fields each hook rewrites at every forward before it reads them: not state to carry.
_TRANSIENT = {"FBCSharedBlockState": frozenset({"head_block_output", "should_compute"}),
              "MagCacheState": frozenset({"head_block_input", "should_compute"})}


class StepCacheHooks:
    """The transformer's hooks, enabled for the step cache of the forward at hand."""

    def __init__(self, transformer: torch.nn.Module,
                 config_for: Callable[[StepCache, int], Any]) -> None:
        self.transformer = cast(CacheMixin, transformer)
        self._modules = transformer
        self._config_for = config_for
        self._enabled: tuple[StepCache, int] | None = None  # the policy, and its step count
        self._managers: list[StateManager] = []

    def forward(self, slot: CachedForward, call: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``call()`` with the hooks of ``slot.cache`` holding the branch's state; the state
        after it lands in ``slot``. Forwards under hooks must not overlap: one thread at a
        time, and no forward without hooks meanwhile (``off`` first)."""
        self._enable(slot.cache, slot.steps)
        before = slot.before or (None,) * len(self._managers)
        for manager, fields in zip(self._managers, before, strict=True):
            manager._state_cache.pop(_CONTEXT, None)
            if fields is not None:
                manager._state_cache[_CONTEXT] = _state(manager, fields)
        with self.transformer.cache_context(_CONTEXT):
            out = call()
        states = [manager._state_cache.pop(_CONTEXT, None) for manager in self._managers]
        slot.skipped = any(_stood_in(state) for state in states if state is not None)
        slot.after = tuple(None if state is None else _fields(state) for state in states)
        return out

    def forward_many(self, slots: Sequence[CachedForward],
                     call: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``forward`` for rows of equal ``decision_key``, batched in ``call()`` in the order
        of ``slots``: their states joined along the batch, and each row's part of the state
        after it handed back to its slot."""
        joined = CachedForward(slots[0].cache, slots[0].steps,
                               _joined([slot.before for slot in slots]))
        out = self.forward(joined, call)
        assert joined.after is not None
        for i, slot in enumerate(slots):
            slot.after = _part(joined.after, i, len(slots))
            slot.skipped = joined.skipped
        return out

    def off(self) -> None:
        """No hooks: the transformer computes every block of every forward."""
        if self._enabled is not None:
            self.transformer.disable_cache()
            self._enabled, self._managers = None, []

    def _enable(self, cache: StepCache, steps: int) -> None:
        if self._enabled == (cache, steps):
            return
        self.off()
        self.transformer.enable_cache(self._config_for(cache, steps))
        self._enabled = cache, steps
        self._managers = _state_managers(self._modules)


@dataclass
class RunStepCache:
    """A run's step cache: its hook state per branch, and what it computed and skipped."""

    cache: StepCache
    steps: int  # the trajectory's (MagCache's configuration depends on it)
    state: RunHookState = field(default_factory=dict)
    forwards: int = 0
    skipped: int = 0

    def attach(self, rows: Sequence[Row]) -> list[Row]:
        """The plan's rows, each to run under this run's state for its branch."""
        return [replace(row, cached=CachedForward(self.cache, self.steps,
                                                  self.state.get(branch, ())))
                for row, branch in zip(rows, BRANCHES, strict=False)]

    def commit(self, rows: Sequence[Row]) -> None:
        """Take the state the rows' forwards left: the step is the run's now."""
        for row, branch in zip(rows, BRANCHES, strict=False):
            slot = row.cached
            assert slot is not None and slot.after is not None
            self.state[branch] = slot.after
            self.forwards += 1
            self.skipped += slot.skipped


class _Unjoinable(Exception):  # noqa: N818 - a signal inside decision_key
    pass


def decision_key(slot: CachedForward) -> Hashable | None:
    """Equal for rows whose hooks are bound to decide alike this forward: the same policy,
    parameters and step count, and states alike in everything but their rows' tensors (the
    counters, accumulators and shapes that TaylorSeer's and MagCache's decisions are made
    of). None where a row's decision depends on its own data (first-block's residual test),
    or its state has parts that cannot be joined along a batch."""
    if slot.cache.policy is StepCachePolicy.FIRST_BLOCK:
        return None
    try:
        return slot.cache, slot.steps, _layout(slot.before)
    except _Unjoinable:
        return None


def _layout(value: Any) -> Hashable:
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            return "scalar", value.dtype, value.item()
        if value.shape[0] != 1:
            raise _Unjoinable
        return "rows", value.dtype, tuple(value.shape[1:])
    if isinstance(value, torch.Size):  # a shape with the batch in it
        raise _Unjoinable
    if isinstance(value, dict):
        return "dict", tuple((k, _layout(v)) for k, v in value.items())
    if isinstance(value, list | tuple):
        return type(value).__name__, tuple(_layout(v) for v in value)
    return value  # None, a number, a dtype or a device


def _joined(values: Sequence[Any]) -> Any:
    """Row states of equal layout as one: tensors along the batch, the rest as they are."""
    first = values[0]
    if isinstance(first, torch.Tensor) and first.dim() > 0:
        return torch.cat(list(values))
    if isinstance(first, dict):
        return {k: _joined([v[k] for v in values]) for k in first}
    if isinstance(first, list | tuple):
        return type(first)(_joined(list(column)) for column in zip(*values, strict=True))
    return first


def _part(value: Any, i: int, rows: int) -> Any:
    """Row ``i``'s part of a state a forward of ``rows`` rows left."""
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        if value.shape[0] != rows:
            raise ValueError(f"a hook state tensor of shape {tuple(value.shape)} is not along "
                             f"a batch of {rows}")
        return value[i:i + 1]
    if isinstance(value, dict):
        return {k: _part(v, i, rows) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_part(v, i, rows) for v in value)
    return value


def _state_managers(transformer: torch.nn.Module) -> list[StateManager]:
    """Every state manager of the transformer's hooks, in module order (the same on every
    worker that enables the same configuration on the same model)."""
    found: dict[int, StateManager] = {}
    for module in transformer.modules():
        registry = getattr(module, "_diffusers_hook", None)
        if registry is None:
            continue
        for name in registry._hook_order:
            for value in vars(registry.hooks[name]).values():
                if isinstance(value, StateManager):
                    found.setdefault(id(value), value)
    return list(found.values())


def _state(manager: StateManager, fields: HookFields) -> Any:
    """A fresh hook state holding ``fields``, its containers and scalars copied (a hook updates
    them in place, and the run's own state must not change until its step is done)."""
    make = cast(Callable[..., Any], manager._state_cls)  # typed as an instance upstream
    state = make(*manager._init_args, **manager._init_kwargs)
    unknown = fields.keys() - vars(state).keys()
    if unknown:  # a checkpoint of another hook, or of another diffusers
        raise HookStateError(f"{type(state).__name__} has no fields {sorted(unknown)}")
    for name, value in fields.items():
        setattr(state, name, _copied(value))
    return state


def _fields(state: Any) -> HookFields:
    transient = _TRANSIENT.get(type(state).__name__, frozenset())
    return {name: value for name, value in vars(state).items() if name not in transient}


def _stood_in(state: Any) -> bool:
    """Whether the hook skipped or forecast its part of the forward just run."""
    if getattr(state, "should_compute", True) is False:  # first-block cache
        return True
    step = getattr(state, "current_step", None)  # TaylorSeer: it updates on computed steps
    return step is not None and getattr(state, "last_update_step", step) != step


def _copied(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return value.clone()  # MagCache multiplies its accumulators in place
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copied(v) for v in value]
    return value
