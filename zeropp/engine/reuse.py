"""Stage 3: which units stay whole instead of being freed and gathered again (DeepSpeed's persistence and reuse
distance, counted per unit).

DeepSpeed decides per parameter; the engine gathers, frees and reduces whole units, so it decides per unit:

* **persistent** (``stage3_param_persistence_threshold``, ``stage3_model_persistence_threshold``): a unit of fewer
  parameter elements than the threshold is gathered once after each optimizer step and never freed, taken in model
  order (root first) while the persistent elements add up to no more than the model threshold. DeepSpeed's
  ``numel <= threshold`` of each parameter becomes ``numel < threshold`` of the unit's parameter elements, so a unit
  made of small parameters (a block of a tiny model) persists only if all of it is small. Every persistent unit
  that needs its weights after a step is gathered in ONE collective (``unit.gather_bucketed``) at the start of the
  next forward, instead of one gather per unit in forward and another in backward.
* **kept for reuse** (``stage3_max_reuse_distance``, ``stage3_max_live_parameters``): after its forward, a unit is
  freed unless its backward comes within ``stage3_max_reuse_distance`` elements. Learned from the previous
  forward's gather order ``u_0, ..., u_{k-1}`` (``Prefetcher.order``), the backward visits them in reverse, so
  between the forward and the backward of ``u_i`` the units ``u_{i+1} ... u_{k-1}`` are used twice each: its reuse
  distance is ``2 * sum(numel(u_j), j > i)`` (DeepSpeed walks its trace the same way: every parameter use in
  between counts). The last unit's distance is 0: it is always kept when the distance is at least 1. Kept units are
  chosen from the last one backwards while the elements whole at the end of the forward — the kept units, the root
  unit and the persistent ones — stay within ``stage3_max_live_parameters``.

DeepSpeed's defaults (1e9 and 1e9) therefore keep every unit of a model under a billion parameters whole from its
forward to its backward (as DeepSpeed does): the backward then gathers nothing. Memory per rank, for a model of
``Psi`` parameter elements in the compute dtype (``c`` bytes each): the persistent units' ``c * N`` always, plus at
the end of the forward the kept units' ``c * N``; the bound is what the keys say. Set the distance to 0 for the
smallest footprint (every non-root unit freed after its forward, as before these keys existed) and the threshold
to 0 for no persistent units. Neither choice changes any value computed: a unit kept whole holds exactly what the
re-gather would have written (the hpZ re-gather copies the forward's values; qwZ dequantizes the same codes).
"""

from __future__ import annotations

from .unit import Unit


def persistent_units(units: list[Unit], param_threshold: int, model_threshold: int) -> list[Unit]:
    """The units (of a sharded engine) to keep whole all the time, in ``units``' order (the root unit first)."""
    chosen: list[Unit] = []
    total = 0
    for unit in units:
        if unit.numel < param_threshold and total + unit.numel <= model_threshold:
            chosen.append(unit)
            total += unit.numel
    return chosen


def kept_units(order: list[Unit], max_reuse_distance: int, max_live: int, always_whole: list[Unit]) -> set[int]:
    """``id``s of the units of the forward ``order`` to keep whole from their forward to their backward (see the
    module docstring). ``always_whole``: the units that are whole then anyway (root, persistent), counted against
    ``max_live`` and never returned."""
    whole = {id(u) for u in always_whole}
    live = sum(u.numel for u in always_whole)
    kept: set[int] = set()
    after = 0  # elements of the units after the current one in the forward
    for unit in reversed(order):
        if id(unit) not in whole:
            if 2 * after >= max_reuse_distance or live + unit.numel > max_live:
                break
            kept.add(id(unit))
            live += unit.numel
        after += unit.numel
    return kept
