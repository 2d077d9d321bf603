"""Step caches decided row by row inside a shared forward.

diffusers' cache hooks hold one state and make one decision per forward, for the whole batch.
Here every row of a forward carries its own policy and its own state (one per guidance branch
of its run), and each decision is that row's, made by diffusers 0.42.1's rule as the request
alone makes it: ``FBCHeadBlockHook``/``FBCBlockHook`` (first-block), ``MagCacheHeadHook``/
``MagCacheBlockHook`` (MagCache), ``TaylorSeerCacheHook``/``TaylorSeerState`` (TaylorSeer).

In a forward, every row runs the transformer's embedding and output layers. The head block
runs for every row but MagCache's skipping ones (whose hidden states become their input plus
their last residual); then a first-block row whose head residual barely moved since its last
computed one takes its stored tail residual instead of the remaining blocks. The rows still
computing run the remaining blocks together, the others pass through. TaylorSeer's rows run
every block, and at each attention module they forecast or compute, each by its own count.
So rows of every policy, at every step, share one forward, and each row is bit for bit what
its pipeline with ``transformer.enable_cache(<the same config>)`` computes for it alone (CPU,
one thread per op: ``rows_apart`` keeps each row's arithmetic its own at any batch size).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from keys import StepCache, StepCachePolicy
from workers.engine.forward_rows import Forward, active
from workers.engine.guidance import Row
from workers.engine.hook_state import (
    BranchState,
    CachedForward,
    HookFields,
    HookStateError,
    RunHookState,
)
from workers.engine.transformer_blocks import (
    argument,
    attention_of,
    blocks_of,
    on_rows,
    outputs_of,
)

FORMAT = "row-caches/1"  # in every stored state: a checkpoint of another layout is refused


@dataclass
class FirstBlock:
    """A row's first-block state: its last computed head residual and tail residuals."""

    head_residual: torch.Tensor | None = None
    tail_hidden: torch.Tensor | None = None
    tail_text: torch.Tensor | None = None


@dataclass
class Mag:
    """A row's MagCache state: the last residual of the blocks and the accumulators
    (0-d tensors once a ratio has been taken in, as diffusers leaves them)."""

    previous_residual: torch.Tensor | None = None
    accumulated_ratio: Any = 1.0
    accumulated_err: Any = 0.0
    accumulated_steps: int = 0
    step_index: int = 0


@dataclass
class Taylor:
    """A row's TaylorSeer state at one attention module."""

    current_step: int = -1
    last_update_step: int | None = None
    factors: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)
    dtypes: tuple[torch.dtype, ...] = ()
    # Which outputs are the text stream: kept at the row's own text length, padded to the
    # forward's where texts are padded.
    texts: tuple[bool, ...] = ()


# A row's state for one guidance branch: one state, or one per attention module (TaylorSeer).
RowState = FirstBlock | Mag | list[Taylor]


def to_branch(state: RowState) -> BranchState:
    """``state`` as checkpoint content (``hook_state``'s fields)."""
    modules = state if isinstance(state, list) else [state]
    return tuple({"format": FORMAT, "kind": type(s).__name__, **dataclasses.asdict(s)}
                 for s in modules)


def from_branch(cache: StepCache, stored: BranchState, modules: int) -> RowState:
    """The state ``to_branch`` wrote (a fresh one for ``()``); HookStateError for content of
    another layout or policy, so a checkpoint written otherwise is not resumed from."""
    kind = {StepCachePolicy.FIRST_BLOCK: FirstBlock, StepCachePolicy.MAGCACHE: Mag,
            StepCachePolicy.TAYLORSEER: Taylor}[cache.policy]
    if not stored:
        return [Taylor() for _ in range(modules)] if kind is Taylor else kind()
    states = []
    for fields in stored:
        if fields is None or fields.get("format") != FORMAT or fields.get("kind") != \
                kind.__name__:
            raise HookStateError(f"a {cache.policy.value} state of another layout")
        states.append(kind(**{k: v for k, v in fields.items() if k not in ("format", "kind")}))
    if kind is Taylor:
        if len(states) != modules:
            raise HookStateError(f"a TaylorSeer state of {len(states)} modules, not {modules}")
        return states
    return states[0]


def _copy(state: RowState) -> RowState:
    """A state to change in a forward, leaving the row's own as it was (tensors are never
    changed in place, so a shallow copy will do)."""
    if isinstance(state, list):
        return [dataclasses.replace(s, factors={i: dict(f) for i, f in s.factors.items()})
                for s in state]
    return dataclasses.replace(state)


BRANCHES = ("cond", "uncond")  # a plan's rows, in order
# The policies whose skipping rows pass the blocks by, and so ride along in a forward at
# little cost; a TaylorSeer row that forecasts still runs every block but its attention.
PASS_BLOCKS_BY = frozenset({StepCachePolicy.FIRST_BLOCK, StepCachePolicy.MAGCACHE})


@dataclass
class RunStepCache:
    """A run's step cache: its state per guidance branch, and what it computed and skipped."""

    cache: StepCache
    steps: int  # the trajectory's (MagCache's configuration depends on it)
    state: RunHookState = field(default_factory=dict)
    forwards: int = 0
    skipped: int = 0
    computed_share: float = 1.0  # of its last step's rows, those whose blocks ran

    def attach(self, rows: Sequence[Row]) -> list[Row]:
        """The plan's rows, each to run under this run's state for its branch."""
        return [dataclasses.replace(row, cached=CachedForward(self.cache, self.steps,
                                                              self.state.get(branch, ())))
                for row, branch in zip(rows, BRANCHES, strict=False)]

    def commit(self, rows: Sequence[Row]) -> None:
        """Take the state the rows' forwards left: the step is the run's now."""
        skipped = 0
        for row, branch in zip(rows, BRANCHES, strict=False):
            slot = row.cached
            assert slot is not None and slot.after is not None
            self.state[branch] = slot.after
            skipped += slot.skipped
        self.forwards += len(rows)
        self.skipped += skipped
        if self.cache.policy in PASS_BLOCKS_BY:
            self.computed_share = 1 - skipped / max(len(rows), 1)


def check(state: RunHookState) -> None:
    """HookStateError unless every branch of a stored state is of this module's layout: a
    checkpoint written with another layout is not resumed from."""
    for branch in state.values():
        for fields in branch:
            if fields is not None and fields.get("format") != FORMAT:
                raise HookStateError("a step-cache state of another layout")


@dataclass
class RowCache:
    """One row's step cache within a forward: its policy's diffusers configuration and the
    state it changes (a copy of its run's, which the run takes once its step is whole)."""

    config: Any
    policy: StepCachePolicy
    state: RowState
    skipped: bool = False  # a rule stood in for part of the row's forward
    # Within the forward: what the head block took and gave, for the tail.
    head_input: torch.Tensor | None = None
    head_output: tuple[torch.Tensor, torch.Tensor | None] | None = None


class RowCaches:
    """The transformer's blocks and attention modules, wrapped to run each row's step cache
    (``forward``); outside a forward with caches they call straight through."""

    def __init__(self, transformer: torch.nn.Module,
                 config_for: Callable[[StepCache, int], Any]) -> None:
        self._config_for = functools.cache(config_for)
        self.blocks = blocks_of(transformer)
        if len(self.blocks) < 2:
            raise ValueError("a transformer of fewer than two blocks has no first block to "
                             "decide from and no others to skip")
        self.outputs = outputs_of(self.blocks[0])
        taylor = self._config_for(StepCache.create(StepCachePolicy.TAYLORSEER), 1)
        self.attention = [m for _, m in attention_of(transformer, taylor.cache_identifiers)]
        for k, block in enumerate(self.blocks):
            block.forward = functools.partial(self._block, k, block.forward)
        for m, module in enumerate(self.attention):
            module.forward = functools.partial(self._attention, m, module.forward)

    def row(self, slot: CachedForward) -> RowCache:
        """``slot``'s row in a forward: its policy, and a copy of its branch's state."""
        config = self._config_for(slot.cache, slot.steps)
        state = from_branch(slot.cache, slot.before, len(self.attention))
        return RowCache(config, slot.cache.policy, _copy(state))

    @staticmethod
    def settle(slot: CachedForward, row: RowCache) -> None:
        """What ``row``'s forward left, in ``slot``."""
        slot.after = to_branch(row.state)
        slot.skipped = row.skipped

    @staticmethod
    def _active() -> Forward[RowCache] | None:
        forward = active()
        if forward is None or all(row is None for row in forward.caches):
            return None
        return forward

    # --- blocks: first-block and MagCache --------------------------------------------------

    def _block(self, k: int, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        forward = self._active()
        if forward is None:
            return original(*args, **kwargs)
        block = self.blocks[k]
        hidden = argument(block, "hidden_states", args, kwargs)
        text = argument(block, "encoder_hidden_states", args, kwargs)
        rows = forward.current
        # Rows whose outputs of this block a rule gives: MagCache's skipping ones at the head
        # (input plus residual), then first-block's skipping ones (head plus tail residual).
        given = self._mag_heads(forward, hidden, text) if k == 0 else {}
        computing = [j for j, r in enumerate(rows) if r not in forward.passing]
        out_hidden, out_text = hidden[:0], None
        if len(computing) == len(rows):
            out_hidden, out_text = self.outputs.split(original(*args, **kwargs))
        elif computing:
            with forward.holding([rows[j] for j in computing]):
                index = torch.tensor(computing, device=hidden.device)
                out_hidden, out_text = self.outputs.split(on_rows(block, original, index,
                                                                  args, kwargs))
        mine = {rows[j]: (out_hidden[c:c + 1], _row_of(out_text, c))
                for c, j in enumerate(computing)}
        if k == 0:
            given |= self._first_block_heads(forward, hidden, mine)
        if k == len(self.blocks) - 1:
            self._tails(forward, mine)
        if not given and len(computing) == len(rows):
            return self.outputs.join(out_hidden, out_text)
        pieces = [given[r] if r in given else mine[r] if r in mine
                  else (hidden[j:j + 1], _row_of(text, j))  # passing through the block
                  for j, r in enumerate(rows)]
        joined = torch.cat([h for h, _ in pieces])
        if self.outputs.text is None:  # the block gives its hidden states alone
            return self.outputs.join(joined, None)
        return self.outputs.join(joined, torch.cat([t for _, t in pieces if t is not None]))

    def _mag_heads(self, forward: Forward[RowCache], hidden: torch.Tensor, text: torch.Tensor | None
                   ) -> dict[int, tuple[torch.Tensor, torch.Tensor | None]]:
        """MagCache's decision for each of its rows at the head, and the hidden states of
        those that skip every block (their text passing through)."""
        given = {}
        for j, r in enumerate(forward.current):
            row = forward.caches[r]
            if row is not None and row.policy is StepCachePolicy.MAGCACHE:
                skip = _mag_head(row, hidden[j:j + 1])
                if skip is not None:
                    given[r] = (skip, _row_of(text, j))
                    forward.passing.add(r)
        return given

    @staticmethod
    def _first_block_heads(forward: Forward[RowCache], hidden: torch.Tensor,
                           mine: dict[int, tuple[torch.Tensor, torch.Tensor | None]]
                           ) -> dict[int, tuple[torch.Tensor, torch.Tensor | None]]:
        """First-block's decision for each of its rows after the head, and the outputs of
        those that skip the remaining blocks."""
        given = {}
        for j, r in enumerate(forward.current):
            row = forward.caches[r]
            if r in mine and row is not None and row.policy is StepCachePolicy.FIRST_BLOCK:
                skip = _first_block_head(row, hidden[j:j + 1], mine[r])
                if skip is not None:
                    given[r] = skip
                    forward.passing.add(r)
        return given

    @staticmethod
    def _tails(forward: Forward[RowCache],
               mine: dict[int, tuple[torch.Tensor, torch.Tensor | None]]) -> None:
        """The tail's hooks: each row that computed it keeps its residuals; each MagCache row
        takes its step, skipping or not."""
        for r in forward.current:
            row = forward.caches[r]
            if row is None:
                continue
            if r in mine and r not in forward.passing:
                _tail(row, mine[r],
                      None if forward.text is None else forward.text.text_length(r))
            elif row.policy is StepCachePolicy.MAGCACHE:
                _mag_advance(row)

    # --- attention modules: TaylorSeer -----------------------------------------------------

    def _attention(self, m: int, original: Callable[..., Any], *args: Any,
                   **kwargs: Any) -> Any:
        forward = self._active()
        rows = [] if forward is None else forward.current
        taylor = [j for j, r in enumerate(rows) if forward is not None and
                  (row := forward.caches[r]) is not None and
                  row.policy is StepCachePolicy.TAYLORSEER]
        if forward is None or not taylor:
            return original(*args, **kwargs)
        module = self.attention[m]
        forecast = set()
        for j in taylor:
            row = forward.caches[rows[j]]
            assert row is not None and isinstance(row.state, list)
            if not _taylor_computes(row.config, row.state[m]):
                forecast.add(j)
                row.skipped = True
        computing = [j for j in range(len(rows)) if j not in forecast]
        computed: list[torch.Tensor] = []
        if len(computing) == len(rows):
            computed = _as_tuple(original(*args, **kwargs))
        elif computing:
            with forward.holding([rows[j] for j in computing]):
                index = torch.tensor(computing, device=_first_tensor(args, kwargs).device)
                computed = _as_tuple(on_rows(module, original, index, args, kwargs))
        at = {j: c for c, j in enumerate(computing)}
        texts = _text_outputs(computed, argument(module, "hidden_states", args, kwargs),
                              argument(module, "encoder_hidden_states", args, kwargs))
        per_row: list[list[torch.Tensor]] = []
        for j, r in enumerate(rows):
            row = forward.caches[r]
            own = None if forward.text is None else forward.text.text_length(r)
            if j in forecast:
                assert row is not None and isinstance(row.state, list)
                padded = forward.text.padded if forward.text is not None else None
                outputs = _taylor_predict(row.state[m], padded)
            else:
                c = at[j]
                outputs = [o[c:c + 1] for o in computed]
                if j in taylor:
                    assert row is not None and isinstance(row.state, list)
                    row.state[m].texts = texts
                    _taylor_update(row.config, row.state[m],
                                   [o[:, :own] if text and own is not None else o
                                    for o, text in zip(outputs, texts, strict=True)])
            per_row.append(outputs)
        joined = [torch.cat([outs[i] for outs in per_row]) for i in range(len(per_row[0]))]
        return joined[0] if len(joined) == 1 else tuple(joined)


# --- the rules, as diffusers 0.42.1 applies them to a request alone -------------------------

def _row_of(tensor: torch.Tensor | None, j: int) -> torch.Tensor | None:
    return None if tensor is None else tensor[j:j + 1]


def _first_block_head(row: RowCache, hidden_in: torch.Tensor,
                      out: tuple[torch.Tensor, torch.Tensor | None]
                      ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``FBCHeadBlockHook.new_forward`` for one row: its outputs if it skips the remaining
    blocks (the stored tail residuals added to the head's), else None, having kept the head's
    output and residual."""
    state = row.state
    assert isinstance(state, FirstBlock)
    residual = out[0] - hidden_in
    if state.head_residual is None:
        compute = True
    else:
        absmean = (residual - state.head_residual).abs().mean()
        previous = state.head_residual.abs().mean()
        compute = (absmean / previous).item() > row.config.threshold
    if not compute:
        assert state.tail_hidden is not None
        row.skipped = True
        text = out[1]
        if text is not None and state.tail_text is not None:
            length = state.tail_text.shape[1]
            mine = state.tail_text + text[:, :length]
            text = mine if length == text.shape[1] else torch.cat([mine, text[:, length:]],
                                                                   dim=1)
        return state.tail_hidden + out[0], text
    row.head_output = out
    state.head_residual = residual
    return None


def _mag_head(row: RowCache, hidden_in: torch.Tensor) -> torch.Tensor | None:
    """``MagCacheHeadHook.new_forward`` for one row: its hidden states (input plus its last
    residual) if it skips every block, else None, having kept the head's input."""
    state, config = row.state, row.config
    assert isinstance(state, Mag)
    row.head_input = hidden_in
    compute = True
    step = state.step_index
    scale = 1.0 if step >= len(config.mag_ratios) else config.mag_ratios[step]
    if step >= int(config.retention_ratio * config.num_inference_steps + 0.5):
        state.accumulated_ratio = state.accumulated_ratio * scale
        state.accumulated_steps += 1
        state.accumulated_err = state.accumulated_err + abs(1.0 - state.accumulated_ratio)
        if (state.previous_residual is not None
                and state.accumulated_err <= config.threshold
                and state.accumulated_steps <= config.max_skip_steps):
            compute = False
        else:
            state.accumulated_ratio, state.accumulated_steps = 1.0, 0
            state.accumulated_err = 0.0
    if compute:
        return None
    row.skipped = True
    residual = state.previous_residual
    assert residual is not None
    if residual.shape != hidden_in.shape:
        raise ValueError(f"MagCache residual {tuple(residual.shape)} does not fit hidden "
                         f"states {tuple(hidden_in.shape)}")
    return hidden_in + residual.to(hidden_in.device)


def _tail(row: RowCache, out: tuple[torch.Tensor, torch.Tensor | None],
          own: int | None = None) -> None:
    """The tail block's hooks for a row that computed it (``own``: as for the head)."""
    state = row.state
    if isinstance(state, FirstBlock):
        assert row.head_output is not None
        state.tail_hidden = out[0] - row.head_output[0]
        head_text = row.head_output[1]
        state.tail_text = (None if out[1] is None or head_text is None
                           else out[1][:, :own] - head_text[:, :own])
    elif isinstance(state, Mag):
        assert row.head_input is not None
        state.previous_residual = out[0] - row.head_input
        _mag_advance(row)


def _mag_advance(row: RowCache) -> None:
    """``MagCacheBlockHook._advance_step``: the next step, and a fresh state after the last."""
    state = row.state
    assert isinstance(state, Mag)
    state.step_index += 1
    if state.step_index >= row.config.num_inference_steps:
        row.state = Mag()


def _taylor_computes(config: Any, state: Taylor) -> bool:
    """``TaylorSeerCacheHook._measure_should_compute``: this module's next call computes."""
    state.current_step += 1
    step = state.current_step
    warmup = step < config.disable_cache_before_step
    interval = (step - config.disable_cache_before_step - 1) % config.cache_interval == 0
    cooldown = config.disable_cache_after_step is not None and \
        step >= config.disable_cache_after_step
    return warmup or interval or cooldown


def _taylor_update(config: Any, state: Taylor, outputs: Sequence[torch.Tensor]) -> None:
    """``TaylorSeerState.update`` for one row's outputs of the module."""
    state.dtypes = tuple(o.dtype for o in outputs)
    for i, features in enumerate(outputs):
        new: dict[int, torch.Tensor] = {0: features}
        if state.last_update_step is not None:
            delta = state.current_step - state.last_update_step
            if delta == 0:
                raise ValueError("Delta step cannot be zero for TaylorSeer update.")
            previous = state.factors.get(i, {})
            for j in range(config.max_order):
                prev = previous.get(j)
                if prev is None or prev.shape != new[j].shape:
                    break
                new[j + 1] = (new[j] - prev.to(features.dtype)) / delta
        kept = {order: f.to(config.taylor_factors_dtype) for order, f in new.items()}
        # Not a view of the forward's output: it would hold the whole batch's.
        kept[0] = kept[0].clone() if kept[0].data_ptr() == features.data_ptr() else kept[0]
        state.factors[i] = kept
    state.last_update_step = state.current_step


def _text_outputs(outputs: Sequence[torch.Tensor], hidden: torch.Tensor | None,
                  text: torch.Tensor | None) -> tuple[bool, ...]:
    """Which of an attention module's outputs are the text stream: those as long as its text
    input, the later one where the image stream is as long too (diffusers' dual-stream
    attention returns the image's first)."""
    if text is None or not outputs:
        return tuple(False for _ in outputs)
    length = text.shape[1]
    same = hidden is not None and hidden.dim() > 1 and hidden.shape[1] == length
    return tuple(o.dim() > 1 and o.shape[1] == length and (not same or i > 0)
                 for i, o in enumerate(outputs))


def _taylor_predict(state: Taylor, padded: int | None = None) -> list[torch.Tensor]:
    """``TaylorSeerState.predict`` for one row; a text output padded to ``padded``
    positions (the padding's values are never read by the row's own)."""
    if state.last_update_step is None or not state.factors:
        raise HookStateError("TaylorSeer forecast before its first computed step")
    offset = state.current_step - state.last_update_step
    orders = len(state.factors[0])
    outputs = []
    for i, dtype in enumerate(state.dtypes):
        factors = state.factors[i]
        output = torch.zeros_like(factors[0], dtype=dtype)
        for order in range(orders):
            output = output + factors[order].to(dtype) * (offset ** order / math.factorial(order))
        if padded is not None and i < len(state.texts) and state.texts[i] and \
                output.shape[1] < padded:
            pad = output.new_zeros((output.shape[0], padded - output.shape[1],
                                    *output.shape[2:]))
            output = torch.cat([output, pad], dim=1)
        outputs.append(output)
    return outputs


def _as_tuple(output: Any) -> list[torch.Tensor]:
    return [output] if isinstance(output, torch.Tensor) else list(output)


def _first_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    return next(v for v in [*args, *kwargs.values()] if isinstance(v, torch.Tensor))


__all__ = ["BRANCHES", "FORMAT", "FirstBlock", "HookFields", "Mag", "RowCache", "RowCaches",
           "RunStepCache", "Taylor", "check", "from_branch", "to_branch"]
