"""The fused mode's options and the defaults chosen from the data (no torch: the CLI validates a
run with them).

What the user leaves out is decided once, at start, and stored in the spec (:func:`settle_options`),
so every machine and ``resume`` read the same values and the math never depends on the pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, cast

from tensorturn.modes.fused.plan import Bounds, Given, Machine, OuterSide, Plan, choose
from tensorturn.modes.fused.policies import POLICIES
from tensorturn.spec import ModeOptions, Workload, check_bounds

if TYPE_CHECKING:
    from tensorturn.recipes import Recipe
    from tensorturn.spec import RunSpec

OUTERS = ("auto", "nesterov", "sgd")
# the --sync choices: the registry's policies (:data:`~.policies.POLICIES` imports none of them)
SYNCS = tuple(POLICIES)
# store.tensors.CODECS, named here without importing torch (test_math checks they agree)
CODECS = ("fp32", "fp16", "int8", "int4", "ternary", "int2")
KEEPS = ("last", "best")
PLANS = ("auto", "off")
# what --plan off (and a run from before the plan) has for what the user left out
STATIC_CODEC, STATIC_SYNC = "fp32", "rounds"
AUTO_NESTEROV_EPOCHS = 1.0  # --outer auto: Nesterov when a shard's round covers its rows at most this often
# a shard going over its rows more often than this per round, with --shards or --sync-every
# given, is warned about (little data)
EPOCHS_PER_ROUND_WARNING = 4.0
# Defaults scaled to the data, when --shards / --sync-every are not given (benchmarks/defaults.py
# --scaled): fewer shards and H than 8 × 25 on little data matched or beat them on digits and the
# small tables, 2-4× faster; a cap of 4 passes beat 1 and 2, which undertrain the smallest sets.
MAX_SHARDS = 8           # large data: 8 shards, so the math does not depend on the pool
ROWS_PER_SHARD = 700     # one shard per this many training rows, 2 to MAX_SHARDS
MAX_SYNC_EVERY = 25      # H on large data
EPOCHS_PER_ROUND = EPOCHS_PER_ROUND_WARNING  # H is cut so a shard goes over its rows at most this often


def default_outer_lr(outer: str) -> float:
    """The outer learning rate left out: DiLoCo's 0.7 for Nesterov, 1.0 (plain averaging,
    FedAvg) for sgd."""
    return 0.7 if outer == "nesterov" else 1.0


@dataclass
class FusedOptions(ModeOptions):
    HELP = """
    rounds          outer rounds
    sync_every      inner steps per shard between weight averages (H); unset: 25, fewer when shards hold few rows
    shards          virtual replicas per round (more than machines lets fast ones take more); unset: 1 per 700 rows, 2-8
    outer           outer optimizer: nesterov (DiLoCo), sgd (lr 1: FedAvg), auto (sgd if shards see rows >1× a round)
    outer_lr        outer learning rate (default 0.7 for nesterov, 1.0 for sgd)
    outer_momentum  outer momentum
    codec           pseudo-gradients up, moves down unless --broadcast-codec (int8 3.9×, int4 7×, int2 15×, ternary 18×)
    broadcast_codec encoding of the weight moves down, if not the codec (home downlinks are ~5× the uplinks)
    keep            the result: the last round's weights, or those of the round with the lowest validation loss
    eval_every      validation figures every this many rounds and for the last; the others record training figures only
    sync            rounds: barrier per round; backup: +copies of stragglers; async: none; overlap: one step apart
    plan            auto: codecs, sync and H left out chosen from links and step times; off: fp32, rounds, H from data
    """
    CHOICES = {"outer": OUTERS, "codec": CODECS, "broadcast_codec": CODECS, "keep": KEEPS, "sync": SYNCS,
               "plan": PLANS}

    rounds: int = 8
    sync_every: int | None = None       # None: from the data at start (see fill_from_data)
    shards: int | None = None           # None: from the data at start
    outer: str = "auto"                 # decided at start from the data (see resolve_outer)
    outer_lr: float | None = None       # None: default_outer_lr(outer)
    outer_momentum: float = 0.9
    codec: str | None = None            # None: planned at start (--plan off: fp32)
    broadcast_codec: str | None = None  # None: the codec's (or planned)
    keep: str = "last"
    eval_every: int = 1
    sync: str | None = None             # None: planned at start (--plan off: rounds)
    plan: str = "auto"
    # the plan made at start (plan.Plan.to_json(), with the figures it was made from), kept in the
    # spec so every machine and resume read the same; {} with --plan off
    planned: dict = field(default_factory=dict)
    # a pseudo-gradient whose norm exceeds this multiple of the weights' norm is rejected
    max_update_ratio: float = 10.0
    # derived at start: sha256 of θ_0's model file, so machines can rebuild θ_0 from the seed
    init_sha256: str = ""
    # which of shards, sync_every, codec and sync TensorTurn chose (from the data, the plan, or a
    # command's own defaults) rather than the user: a run warns about its shards' passes only for the user's
    chosen: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.outer_lr is None and self.outer != "auto":
            self.outer_lr = default_outer_lr(self.outer)

    def fill_from_data(self, train_rows: int, samples_per_step: int) -> None:
        """Choose the shards and H the user did not give, from the data: :func:`default_shards`,
        then :func:`default_sync_every` for those shards. Done once, at start, and stored in the
        spec, so every machine and ``resume`` use the same values (the math never depends on
        the pool)."""
        if self.shards is None:
            self.shards = default_shards(train_rows)
            self.chosen.append("shards")
        if self.sync_every is None:
            self.sync_every = default_sync_every(train_rows, self.shards, samples_per_step)
            self.chosen.append("sync_every")

    def resolve_outer(self, epochs_per_round: float) -> str | None:
        """Decide ``auto``: DiLoCo's Nesterov outer step (lr 0.7, momentum 0.9) when a shard's
        round covers its rows at most once — large data, as in the paper and on ``charlm`` — and
        plain averaging (FedAvg: sgd, lr 1) when it goes over them again and again: on small
        data the Nesterov step overshoots (benchmarks/defaults.py: test NLL 0.34 vs 0.15 on digits,
        0.57 vs 0.05 on breast cancer). Returns a sentence on what was chosen, for the run."""
        if self.outer != "auto":
            return None
        overlapped = self.sync == "overlap"
        self.outer = "nesterov" if epochs_per_round <= AUTO_NESTEROV_EPOCHS and not overlapped else "sgd"
        if self.outer_lr is None:
            self.outer_lr = default_outer_lr(self.outer)
        if self.outer == "nesterov":
            return None
        if overlapped:  # benchmarks/codecs.py --syncs overlap: val loss 1.96 with Nesterov, 1.69 with sgd
            return ("outer optimizer sgd (FedAvg), chosen by --outer auto for --sync overlap: a "
                    "Nesterov step on pseudo-gradients one round late overshoots (--outer nesterov "
                    "forces it)")
        return (f"outer optimizer sgd (FedAvg), chosen by --outer auto: each shard goes over its "
                f"rows {epochs_per_round:.1f} times a round, where DiLoCo's Nesterov step overshoots "
                f"(--outer nesterov forces it)")

    def fill_static(self) -> None:
        """``--plan off``: what the user left out of the codec and sync as before the plan (fp32,
        blocking rounds); the shards and H stay the data's (:meth:`fill_from_data`)."""
        self.codec = self.codec or STATIC_CODEC
        self.sync = self.sync or STATIC_SYNC

    @property
    def plan_chose(self) -> list[str]:
        """The options the plan chose (the user left them out): ``planned["chose"]``."""
        return list(self.planned.get("chose") or [])

    def apply_plan(self, planned: Plan) -> None:
        """Take what the user left out from ``planned`` (:func:`.plan.choose` kept what was
        given), and keep the plan in the spec, with the names of the options it chose."""
        chose = []
        if self.codec is None:
            self.codec = planned.codec
            chose.append("codec")
            if self.broadcast_codec is None and planned.broadcast_codec != planned.codec:
                self.broadcast_codec = planned.broadcast_codec
                chose.append("broadcast_codec")
        if self.sync is None:
            self.sync = planned.sync
            chose.append("sync")
        for name in ("shards", "sync_every"):
            if name in self.chosen and getattr(self, name) != getattr(planned, name):
                setattr(self, name, getattr(planned, name))
                chose.append(name)
        self.planned = {**planned.to_json(), "chose": chose}

    def given(self) -> Given:
        """What the user gave of what the plan chooses (what TensorTurn chose counts as not
        given: a plan made again chooses it again)."""
        def mine(name: str) -> Any:
            return None if name in self.chosen or name in self.plan_chose else getattr(self, name)

        return Given(mine("codec"), mine("broadcast_codec"), mine("sync"), mine("sync_every"))

    def replan(self, planned: Plan) -> list[str]:
        """Take ``planned`` (made again: ``resume --replan``) for what TensorTurn chose at start
        — the codecs and H; the sync policy and the shards stay (a run's rounds and shards are
        recorded by them) — and say what changed."""
        changed, chose = [], self.plan_chose
        for name, value in (("codec", planned.codec), ("broadcast_codec", planned.broadcast_codec),
                            ("sync_every", planned.sync_every)):
            if name not in self.chosen and name not in chose and not (name == "broadcast_codec" and "codec" in chose):
                continue
            before = getattr(self, name) if name != "broadcast_codec" else self.down_codec
            if before != value:
                changed.append(f"{name} {before} → {value}")
                chose = [*chose, name] if name not in chose else chose
            setattr(self, name, value)
        self.planned = {**planned.to_json(), "chose": chose, "shards_fixed": True}
        return changed

    @property
    def down_codec(self) -> str:
        """The broadcast's codec: ``broadcast_codec``, else the pseudo-gradients' ``codec``."""
        return self.broadcast_codec or self.codec or STATIC_CODEC

    def validate(self) -> None:
        super().validate()
        check_bounds({"rounds": self.rounds, "sync_every": self.sync_every, "shards": self.shards,
                      "outer_lr": self.outer_lr, "outer_momentum": self.outer_momentum,
                      "eval_every": self.eval_every})

    def workload(self) -> Workload:
        """A task per shard and round; ``--sync async`` queues them all at once. Shards and H
        left to the data count at the most the data can give them (MAX_SHARDS, MAX_SYNC_EVERY)."""
        shards = self.shards or MAX_SHARDS
        tasks = (self.rounds * shards, "--rounds × --shards")
        queued = (tasks[0], "--sync async: " + tasks[1]) if self.sync == "async" else (shards, "--shards")
        return Workload(tasks=tasks, queued=queued,
                        steps=(self.rounds * (self.sync_every or MAX_SYNC_EVERY),
                               "--rounds × --sync-every"))


class StartedOptions(FusedOptions):
    """What :class:`FusedOptions` are once the run has started (:meth:`~FusedOptions.fill_from_data`,
    then the plan): the shards, H, codec and sync are set. A type for the tasks, never made."""

    shards: int
    sync_every: int
    codec: str
    sync: str


def default_shards(train_rows: int) -> int:
    """Shards when the user gives none: one per ~700 training rows, 2 to 8. On little data many
    small shards each gone over many times a round cost accuracy (benchmarks/distill.py,
    benchmarks/defaults.py); on large data 8 fixed shards keep the math independent of the pool."""
    return max(2, min(MAX_SHARDS, train_rows // ROWS_PER_SHARD))


def default_sync_every(train_rows: int, shards: int, samples_per_step: int,
                       epochs: float = EPOCHS_PER_ROUND) -> int:
    """H when the user gives none: 25, or fewer so that a shard goes over its rows at most
    ``epochs`` times a round (at least 1 step): the small sets of benchmarks/defaults.py went
    over their rows 10-30 times a round with H 25."""
    return min(MAX_SYNC_EVERY, sync_every_bound(train_rows, shards, samples_per_step, epochs))


def sync_every_bound(train_rows: int, shards: int, samples_per_step: int,
                     epochs: float = EPOCHS_PER_ROUND) -> int:
    """The most H the data allows: a shard goes over its rows at most ``epochs`` times a round
    (at least 1 step). The plan raises H up to it (and :data:`.plan.MAX_PLANNED_SYNC_EVERY`)."""
    rows = train_rows / max(shards, 1)
    return max(1, int(epochs * rows // max(samples_per_step, 1)))


# ---- a started run's options -------------------------------------------------------------------

def options(spec: RunSpec) -> StartedOptions:
    """The run's fused options, as the tasks see them: shards and H are filled at start."""
    return cast(StartedOptions, spec.opts(FusedOptions))


def evaluated(spec: RunSpec, r: int) -> bool:
    """Whether round r's weights are evaluated on the validation split: every ``--eval-every``
    rounds, and the last round always (the run's test and ``--keep`` follow it)."""
    opts = options(spec)
    return (r + 1) % opts.eval_every == 0 or r + 1 >= opts.rounds


def outer_args(spec: RunSpec) -> tuple[float, float, bool]:
    """(lr, momentum, nesterov) of the outer optimizer, for the synchronous outer step and the
    asynchronous applier alike: momentum only with Nesterov (sgd is plain averaging)."""
    opts = options(spec)
    use_momentum = opts.outer == "nesterov" and opts.outer_momentum > 0
    return float(opts.outer_lr or 0), opts.outer_momentum if use_momentum else 0.0, use_momentum


def samples_per_step(spec: RunSpec, recipe: Recipe) -> int:
    """Training rows one inner step reads (the batch × ``--accumulate``)."""
    return spec.batch_for(recipe) * spec.accumulate


def eval_passes(spec: RunSpec, recipe: Recipe) -> int | None:
    """Forward passes (of the recipe's ``eval_batch_size`` rows) that a round's validation figures
    and the final test figures read; None: the whole split. ``--eval-batches`` when given (0: the
    whole split). By default as many rows as one shard trains in a round (H steps × batch), in
    whole passes, at least one — nanoGPT's ``eval_iters``, scaled to the round: a forward pass
    costs about a third of a training step, so evaluating costs about a third of a shard's
    training whatever the model's size, and a split no bigger than that is read whole."""
    if spec.eval_batches is not None:
        return spec.eval_batches or None
    rows = options(spec).sync_every * samples_per_step(spec, recipe)
    return max(1, -(-rows // recipe.eval_batch_size))


def epochs_per_round(spec: RunSpec, recipe: Recipe) -> float:
    """How many times a shard goes over its rows in one round (H steps × batch / its rows)."""
    opts = options(spec)
    rows = recipe.train_rows() / opts.shards
    return opts.sync_every * samples_per_step(spec, recipe) / max(rows, 1.0)


def settle_options(spec: RunSpec, recipe: Recipe, figures: PlanFigures | None = None) -> list[str]:
    """Decide what the user left to the data — the shards and H (:meth:`FusedOptions.fill_from_data`),
    then with ``--plan auto`` the codecs, sync and H from ``figures`` (:func:`make_plan`; without
    figures, or with ``--plan off``, fp32 and blocking rounds), then ``--outer auto`` — once,
    before the spec is stored: every machine and ``resume`` read the same values. Returns the
    warnings ``run`` prints about the setup: none when TensorTurn chose both the shards and H;
    else what ``--outer auto`` chose and :func:`small_data_warning`."""
    opts = options(spec)
    opts.fill_from_data(recipe.train_rows(), samples_per_step(spec, recipe))
    if opts.plan == "auto" and figures is not None:
        opts.apply_plan(make_plan(spec, recipe, figures))
    opts.fill_static()
    epochs = epochs_per_round(spec, recipe)
    chosen = opts.resolve_outer(epochs)
    if {"shards", "sync_every"} <= set(opts.chosen):
        return []
    return [w for w in (chosen, small_data_warning(spec, recipe, epochs)) if w]


# step times (s) a plan is tried at to learn whether it depends on the step time at all
STEP_GRID_S = (1e-3, 1e-2, 0.1, 1.0, 10.0, 100.0, 1e3)
PLAN_CHOICES = ("codec", "broadcast_codec", "sync", "sync_every", "shards", "outer_role")


@dataclass(frozen=True)
class PlanFigures:
    """What a plan is made from besides the spec and the data: the model's float values, a step's
    seconds where the plan is made (θ_0's, timed; None where the plan chooses alike at any step
    time: then it predicts no utilisation), the trainers (:class:`.plan.Machine`), whether an
    agent beside the store serves the outer queue, sentences on figures not measured, and what
    the agents that take the outer step measured."""

    values: int
    step_s: float | None
    machines: tuple[Machine, ...] = ()
    outer_beside_store: bool = False
    notes: tuple[str, ...] = ()
    outer: OuterSide | None = None  # what the agents that take the outer step measured (None: the model's)


def make_plan(spec: RunSpec, recipe: Recipe, figures: PlanFigures) -> Plan:
    """The plan (:func:`.plan.choose`) for ``spec``'s fused run, its shards and the data's H set
    (:meth:`FusedOptions.fill_from_data`), around the options the user gave."""
    opts = options(spec)
    sps = samples_per_step(spec, recipe)
    data_h = default_sync_every(recipe.train_rows(), opts.shards, sps) if "sync_every" in opts.chosen \
        else opts.sync_every
    planned_shards = "shards" in opts.chosen and not opts.planned.get("shards_fixed")
    bounds = Bounds(opts.shards, data_h, sync_every_bound(recipe.train_rows(), opts.shards, sps),
                    rows_per_step=recipe.train_rows() / max(sps, 1) if planned_shards else 0.0,
                    epochs=EPOCHS_PER_ROUND, data_max=MAX_SYNC_EVERY, max_shards=MAX_SHARDS)
    if figures.step_s is not None:
        return choose(figures.values, figures.machines, figures.step_s, bounds, opts.given(),
                      figures.outer_beside_store, figures.notes, figures.outer)
    planned = choose(figures.values, figures.machines, STEP_GRID_S[0], bounds, opts.given(),
                     figures.outer_beside_store, figures.notes, figures.outer)
    return replace(planned, predicted_utilisation=None, round_s=None)


def step_matters(spec: RunSpec, recipe: Recipe, figures: PlanFigures) -> bool:
    """Whether the plan for ``figures`` (its ``step_s`` left out) chooses otherwise at some step
    time of :data:`STEP_GRID_S`: a small model whose H the user gave, say, is planned alike at
    any (its transfers are nothing at any link), and its steps need not be timed to plan it."""
    chosen = {tuple(getattr(plan, name) for name in PLAN_CHOICES)
              for plan in (make_plan(spec, recipe, replace(figures, step_s=step)) for step in STEP_GRID_S)}
    return len(chosen) > 1


def small_data_warning(spec: RunSpec, recipe: Recipe, epochs: float) -> str | None:
    """A warning when each shard goes over its rows (``epochs`` times a round) many times: with
    little data, local steps overfit their shard and validation loss tends to rise after a few
    rounds."""
    opts = options(spec)
    rows = recipe.train_rows() / opts.shards
    if epochs <= EPOCHS_PER_ROUND_WARNING:
        return None
    accumulated = f" × {spec.accumulate} accumulated" if spec.accumulate > 1 else ""
    return (f"each shard holds about {rows:.0f} training rows but trains {opts.sync_every} steps × "
            f"batch {spec.batch_for(recipe)}{accumulated} per round, going over them "
            f"{epochs:.0f} times: fewer --sync-every or --shards suit this little data (left out, "
            f"both are chosen from the data); --keep best keeps the round with the lowest "
            f"validation loss")
