"""The Plan's cross-field checks (a mixin of :class:`whale.plan.plan.Plan`, run by ``Plan.validate`` on every
construction): task graphs against the world size, lane and ZeRO weights, the rank order and the stage cut.
Each failure is a :class:`~whale.plan.checks.PlanError` naming the field path, the value and the fix.
"""

from __future__ import annotations

import functools

from whale.plan.checks import PlanError, _fail
from whale.plan.schedule import ScheduleError
from whale.plan.schedule_chunks import schedule_for

_REPLAN = "re-plan with wh.plan_model (or `whale plan --out`) instead of editing which TaskGraph holds a module"


@functools.lru_cache(maxsize=16)
def _cut_prefixes(cuts: tuple) -> tuple[frozenset[str], ...]:
    """Per stage, every tensor FQN of its cut and every module prefix of one (``a.b.c`` -> ``a``, ``a.b``,
    ``a.b.c``): the module names the cut puts in that stage."""
    out = []
    for cut in cuts:
        names = set()
        for name in (*cut.params, *cut.buffers):
            parts = name.split(".")
            names.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
        out.append(frozenset(names))
    return tuple(out)


class PlanChecks:
    """Cross-field checks of a :class:`~whale.plan.plan.Plan` (see the module docstring)."""

    def _validate_zero(self) -> None:
        if self.zero > 3:
            _fail("zero", self.zero, "is not a ZeRO stage",
                  "use 0, 1 (optimizer state sharded), 2 (also gradients) or 3 (also parameters)")
        if self.offload == "optimizer+params" and self.zero in (1, 2):
            _fail("offload", self.offload, f"keeps the parameters on the host, which ZeRO-{self.zero} keeps whole "
                  "on the device", "use offload='optimizer' with zero >= 1, or zero=0 or 3")
        if self.zero_weights and not self.zero:
            _fail("zero_weights", [list(w) for w in self.zero_weights], "shards nothing while zero = 0",
                  "set zero >= 1 or leave zero_weights []")
        if self.zero_weights and len(self.zero_weights) != self.num_stages:
            _fail("zero_weights", [list(w) for w in self.zero_weights], f"must hold one list per stage "
                  f"({self.num_stages})", "give each stage the relative shard size of each of its lanes")
        for s, weights in enumerate(self.zero_weights):
            if len(weights) != self.lanes_of(s) or not sum(weights) > 0:
                _fail(f"zero_weights[{s}]", list(weights), f"must hold {self.lanes_of(s)} numbers >= 0 (one per "
                      "lane of the stage) with a positive sum", "give one relative shard size per lane")

    def _validate_lane_weights(self, where: str, weights: tuple[float, ...], stage: int) -> None:
        lanes, k, n = self.lanes_of(stage), self.num_replicas, self.width_of(stage)
        if len(weights) != lanes:
            _fail(where, list(weights), f"must hold {lanes} positive numbers, one per data-parallel lane",
                  f"give {k} replica(s) x {n} device(s) = {lanes}")

    def _validate_task_graphs(self) -> None:
        widths = [tg.device_count for tg in self.task_graphs]
        if self.colocated and len(set(widths)) != 1:
            _fail("task_graphs device counts", widths, "differ, but colocated TaskGraphs share their devices",
                  "give them the same device_count")
        for i, tg in enumerate(self.task_graphs):
            if len(set(widths)) != 1 and tg.has_split:
                raise PlanError(
                    f"task_graphs[{i}] ({tg.kind}({tg.device_count}), modules {list(tg.modules)[:3]}) shards "
                    f"operators, but the pipeline's stages have different device counts {widths}; split runs "
                    "only in pipelines whose stages all have the same width: give every stage the same "
                    "device_count, or use replicate in this stage")
        for i, tg in enumerate(self.task_graphs):
            if tg.index != i:
                _fail(f"task_graphs[{i}].index", tg.index, f"must equal its position {i} in task_graphs",
                      f"number the TaskGraphs 0..{len(self.task_graphs) - 1} in model order")
            where = f"task_graphs[{i}]"
            for what, weights in [(f"{where}.shard_weights", tg.shard_weights)] + [
                    (f"{where}.nested[{j}].shard_weights", n.shard_weights) for j, n in enumerate(tg.nested)]:
                if weights and len(weights) != tg.device_count:
                    _fail(what, list(weights), f"must hold {tg.device_count} positive numbers, one per device",
                          f"give one weight per device of the TaskGraph (device_count {tg.device_count}) "
                          "or [] for equal shards")

    def _validate_ranks(self) -> None:
        w = self.world_size
        if self.device_order and sorted(self.device_order) != list(range(w)):
            _fail("device_order", list(self.device_order), f"must be a permutation of 0..{w - 1}",
                  "list every rank once (or [] for the identity)")
        for name, want, of in (("devices", w, "ranks"), ("predicted_utilization", w, "ranks"),
                               ("predicted_memory", w, "ranks"),
                               ("stage_flops", self.num_stages, "stages")):
            if getattr(self, name) and len(getattr(self, name)) != want:
                raise PlanError(f"{name} lists {len(getattr(self, name))} entries for {want} {of}; "
                                f"give one per {of[:-1]} (or [])")

    def _validate_cut(self) -> None:
        if self.stage_cuts and len(self.stage_cuts) != self.num_chunks:
            raise PlanError(f"stage_cuts lists {len(self.stage_cuts)} stages but the plan has {self.num_chunks}")
        self._validate_virtual()
        self._validate_cut_modules()
        seen: dict[str, int] = {}
        for s, cut in enumerate(self.stage_cuts):
            for node in cut.nodes:
                if node in seen:
                    raise PlanError(f"stage_cuts[{s}].nodes lists node {node!r}, and so does stage_cuts"
                                    f"[{seen[node]}].nodes; stage cuts must be "
                                    "disjoint (a graph node runs in exactly one stage): keep it in one stage")
                seen[node] = s
        for i, sp in enumerate(self.shared_params):
            if any(not 0 <= s < self.num_stages for s in sp.stages):
                _fail(f"shared_params[{i}].stages", list(sp.stages), f"names a stage outside 0..{self.num_stages - 1}",
                      f"list the stages holding {list(sp.names)}")
        names = self.activation_checkpoint
        for i, a in enumerate(names):
            inner = next((b for b in names[i + 1:] + names[:i] if a == b or b.startswith(a + ".")), None)
            if not a or inner is not None:
                _fail("activation_checkpoint", list(names), f"lists {a!r} " + (f"and {inner!r} inside it" if a
                      else "(the whole model)"), "list each module once, outermost only, never the root")

    def _validate_virtual(self) -> None:
        """Interleaved plans: whole chunks per stage, each chunk as wide as its stage, one width, no split."""
        v, n = self.virtual_stages, len(self.task_graphs)
        if v == 1:
            if self.chunk_positions:
                _fail("chunk_positions", list(self.chunk_positions), "maps chunks of an interleaved plan, but "
                      "virtual_stages = 1", "leave chunk_positions [] or use virtual_stages >= 2")
            return
        if self.schedule != "Interleaved1F1B":
            _fail("virtual_stages", v, f"needs schedule 'Interleaved1F1B', not {self.schedule!r}",
                  "set schedule='Interleaved1F1B' or virtual_stages=1")
        if self.colocated or n % v or n < 2 * v:
            _fail("virtual_stages", v, f"must divide the {n} pipeline TaskGraphs into >= 2 stages of {v} chunks",
                  f"annotate a multiple of {v} stage scopes (p * {v} for p stages)")
        widths = [tg.device_count for tg in self.task_graphs]
        if len(set(widths)) > 1 or any(tg.has_split for tg in self.task_graphs):
            _fail("virtual_stages", v, f"runs chunks of one width and no split regions, but the TaskGraphs have "
                  f"widths {widths}{' and split regions' if any(tg.has_split for tg in self.task_graphs) else ''}",
                  "give every stage scope the same device count without split, or use the 1F1B schedule")
        self._validate_chunk_positions()
        try:  # the schedule's own rules (micro-batches a multiple of the stages)
            schedule_for(self.schedule, n // v, self.num_micro_batch, v, self.chunk_positions)
        except ScheduleError as exc:
            raise PlanError(str(exc)) from None
        if self.zero >= 3:
            _fail("zero", self.zero, f"gathers parameters around whole-stage calls, which the {v} chunks of an "
                  "interleaved stage are not", "use zero=1 or 2 with virtual_stages > 1, or virtual_stages=1")

    def _validate_chunk_positions(self) -> None:
        """One stage per chunk, every stage ``0..p-1`` holding at least one, chunk 0 (the model's inputs) on stage 0
        (interleaved plans)."""
        pos, p, n = self.chunk_positions, self.num_stages, len(self.task_graphs)
        if pos and (len(pos) != n or sorted(set(pos)) != list(range(p)) or pos[0] != 0):
            _fail("chunk_positions", list(pos), f"must give each of the {n} chunks a stage in 0..{p - 1}, every "
                  "stage at least one chunk and chunk 0 stage 0 (it takes the model's inputs)",
                  "re-plan with wh.plan_model, or leave it [] for round-robin")

    def _validate_cut_modules(self) -> None:
        """A pipeline's TaskGraph s lists modules whose tensors stage s's cut holds: a module listed under
        TaskGraph s whose tensors the cut puts in another stage only (a hand-edited plan) is refused, since the cut
        is what runs and the printout would be wrong."""
        if not self.stage_cuts or len(self.task_graphs) != self.num_stages:
            return
        held = _cut_prefixes(self.stage_cuts)
        for tg in self.task_graphs:
            for name in tg.modules:
                if name in held[tg.index]:
                    continue
                where = [s for s, names in enumerate(held) if name in names]
                if where:  # the cut holds it elsewhere: it was moved (a name no cut holds is left to the model check)
                    raise PlanError(
                        f"task_graphs[{tg.index}].modules lists {name!r} (the plan says TaskGraph {tg.index}), but the "
                        f"stage cut holds its tensors in stage {where[0]}, so it runs in TaskGraph {where[0]}; "
                        f"{_REPLAN}")
