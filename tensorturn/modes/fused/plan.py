"""The fused run's plan: what ``--plan auto`` chooses for the options the user left out — the
codecs up and down, the sync policy, H, and where the outer step belongs — from the model's
bytes, the machines' measured links and step times, and the data's bounds. Pure and torch-free
(the CLI prints a plan with ``run --plan-only``); what gathers the figures is :mod:`.measured`.

**The model of a round** (:func:`predict`). A shard task on machine *i* downloads the broadcast
(its codec's bytes ÷ the machine's down rate), trains H steps (H × its step time), uploads its
pseudo-gradient (the codec's bytes ÷ its up rate) and makes :data:`ROUND_TRIPS_PER_TASK` round
trips to the broker and store (benchmarks: 26.4 a task). The round's S shards go to the M
machines as they free up (waves of tasks: S ≤ M is one wave). The outer step reads S
pseudo-gradients and writes θ, its momentum and the broadcast — beside the store on the store's
disk, on a trainer over that trainer's links — and costs CPU (:func:`outer_units` of work at
the rate the agents that take it measured in their last steady round, :data:`OUTER_S_PER_UNIT`
before any has); a round has :data:`FIXED_ROUND_S` of dispatch besides (the chord, the next
round's queueing). An agent beside the store that takes the outer steps evaluates each round's
weights too, between its steps: its round is at least the step and that evaluation (as it
measured one, :attr:`OuterSide.eval_s`; none before it has).

* Blocking rounds (``rounds``, ``backup``): round = the tasks' makespan + the fixed cost + the
  outer step.
* Overlapped rounds (``overlap``, and ``async`` as an approximation): round r+1 trains while
  round r's uploads, outer step and broadcast go on, so a round lasts the longer of the
  machines' compute (with each task's round trips) and that chain.

Utilisation = the compute the shards do ÷ (M × the round): the figure BENCHMARKS §13b measures
(0.174 predicted for its fp32 blocking row at H = 25, 1.5 s steps, 20/100 Mbit/s: 0.165
measured; 0.35 for its fp32 H = 64 row: 0.330 measured).

**The choice** (:func:`choose`), each decision said in ``why``:

1. sync: blocking rounds where the round's transfers are small against its compute (≤
   :data:`SMALL_COMM` of it at the data's H, or under the round's fixed cost: not worth
   hiding), overlapped where they are not; machines of very different speeds ask
   :func:`choose_for_speeds`.
2-3. codec pair and H: for each pair (fp32, then int8, int4, then ternary up / int2 down), the
   smallest H from the data's default (today's ``default_sync_every``: ≤ 25) up to the data's
   bound (a shard's rows gone over at most 4 times a round) and :data:`MAX_PLANNED_SYNC_EVERY`
   that reaches :data:`TARGET_UTILISATION`; the pair whose H is smallest wins, the most
   faithful among equals — H costs more per sample than a codec (BENCHMARKS §18). When no pair
   reaches it, the pair and H that do the most useful work a second — utilisation ×
   :func:`sample_worth` (a sample at a larger H is worth less) — and of the pairs within a
   tenth of the best, the most faithful. A small model — a round's compute at the data's H under :data:`SMALL_ROUND_S` —
   keeps the data's shards and H: its round's fixed costs weigh on any H the data allows, and
   those were measured on such data (benchmarks/defaults.py).
4. shards: left to the data, and the model not small, the data's made a whole number of waves
   on the machines (2 shards on 3 machines: 3; 8 on 3: 6) — every machine busy to the round's
   end; the model depends on the plan, stored in the spec, not on which machines ran it.
5. outer_role: ``store`` where an agent beside the store serves the outer queue, else
   ``trainer`` (and the plan says that one would help when its links are slow).

Options the user gave always win: they are fixed, and the rest is chosen around them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from tensorturn.modes.fused.speeds import choose_for_speeds

# bytes one value takes in each codec (store/tensors.py: INT8_BLOCK 256, INT4_BLOCK 64,
# TERNARY_BLOCK 256 at 5 codes a byte, INT2_BLOCK 1024 with 2 scales; a float32 scale a block)
BYTES_PER_VALUE = {"fp32": 4.0, "fp16": 2.0, "int8": 1 + 4 / 256, "int4": 0.5 + 4 / 64,
                   "ternary": 1 / 5 + 4 / 256, "int2": 0.25 + 8 / 1024}
UP_CODECS = ("fp32", "int8", "int4", "ternary")   # fidelity first (ternary: the smallest up)
DOWN_CODECS = ("fp32", "int8", "int4", "int2")    # the broadcast's (int2: the smallest down)
TARGET_UTILISATION = 0.9
# the plan goes no higher whatever the links: BENCHMARKS §13b's H = 100 steps of ≈ 1 s (DiLoCo's
# 500 is for large data); past it, the plan compresses more rather than sync less often
MAX_PLANNED_SYNC_EVERY = 100
# a sample's worth against H (sample_worth): 1 up to H = 25, half at H = 99 (BENCHMARKS §18)
WORTH_H, WORTH_EXPONENT = 25, 0.5
SMALL_COMM = 0.1              # transfers this small against a round's compute: blocking rounds
ROUND_TRIPS_PER_TASK = 26     # a shard task's broker and store round trips (BENCHMARKS §13b: 26.4)
TASK_OVERHEAD_S = 0.3         # a task's start and end besides its round trips
FIXED_ROUND_S = 1.0           # a round's dispatch: its last shard seen, outer step and next round queued (§13)
# the outer step's CPU in units (outer_units): a value of a shard read in each up codec (decoded
# and added), θ's step (1), and a value of the move encoded and decoded in each broadcast codec
# — fit to benchmarks/bigmodel.py --part outer (86M values, 3 shards, one thread of an idle
# machine, its computing seconds: fp32/fp32 6.9 s, fp32/int8 7.5, ternary/fp32 8.4,
# ternary/int8 11.1, fp32/int2 12.9, ternary/int2 13.5; BENCHMARKS §11) — and the seconds a unit
# takes where no agent that takes the step has measured its own: twice that thread's 2.0e-8, as
# on the shared cores of BENCHMARKS §11/§13b (their fp32 and ternary rows, tests/unit/test_plan.py)
READ_UNITS = {"fp32": 1.0, "fp16": 1.0, "int8": 1.4, "int4": 1.4, "ternary": 1.4, "int2": 1.4}
BROADCAST_UNITS = {"fp32": 0.0, "fp16": 0.0, "int8": 1.0, "int4": 1.0, "ternary": 3.2, "int2": 3.2}
OUTER_S_PER_UNIT = 4.0e-8
LOOPBACK_BPS = 1e9            # a link not measured: taken as fast as loopback (and said so)
LOOPBACK_RTT_S = 0.0005
BESIDE_STORE_BPS = 5e8        # the outer step's reads and writes on the store's own machine
SPEED_SPREAD = 2.0            # machines whose step times differ more than this (and whose rounds
                              # differ by more than FIXED_ROUND_S): choose_for_speeds
# a round of less compute than this at the data's H keeps the data's shards and H (a small model:
# its round's fixed costs of 1-2 s weigh on any H the data allows; benchmarks/defaults.py
# measured those shards and H on such data)
SMALL_ROUND_S = 10.0


@dataclass(frozen=True)
class Machine:
    """One trainer as the plan sees it: its step time (s, None: not known — the run's measured
    one is used) and its links to the store (bytes/s, None: not measured) and broker (s)."""

    name: str
    step_s: float | None = None
    up_bps: float | None = None
    down_bps: float | None = None
    rtt_s: float | None = None


@dataclass(frozen=True)
class OuterSide:
    """What the agents that take the outer step measured: the seconds a unit of its work takes
    (:func:`outer_units`; None: :data:`OUTER_S_PER_UNIT`). Their transfers beside the store go at
    :data:`BESIDE_STORE_BPS`: an agent's probe of a few MB understates a bulk rate on the store's
    own machine (the speed-up benchmark's outer agent probed moto at 236–417 Mbit/s), and priced
    at it the plan chose ternary over loopback where fp32 keeps up. ``eval_s``: the seconds they
    took to evaluate a round of the recipe (0: not measured yet), which follows each step on the
    same agent: on the speed-up benchmark's shared cores, 27–32 s after a 30–38 s step, and
    rounds of 65 s where the plan without it predicted 55 s (BENCHMARKS §18)."""

    s_unit: float | None = None
    eval_s: float = 0.0


@dataclass(frozen=True)
class Bounds:
    """What the data allows: its shards, its default H (today's) and the most H it allows; with
    ``rows_per_step`` (training rows ÷ rows a step reads), the shards are the plan's to fit to
    the machines too, and these H are worked out again for them (as options.py does)."""

    shards: int
    sync_every: int      # the data's default H (options.default_sync_every)
    max_sync_every: int  # a shard's rows gone over at most ``epochs`` times a round
    rows_per_step: float = 0.0  # 0: the shards are fixed (given, or a small model's)
    epochs: float = 4.0         # options.EPOCHS_PER_ROUND
    data_max: int = 25          # options.MAX_SYNC_EVERY: the data's default H at most
    max_shards: int = 8         # options.MAX_SHARDS

    def for_shards(self, shards: int) -> Bounds:
        """These bounds for ``shards`` shards of the same data."""
        most = max(1, int(self.epochs * self.rows_per_step / shards))
        return replace(self, shards=shards, sync_every=min(self.data_max, most), max_sync_every=most)


def fitted_shards(shards: int, machines: int, most: int) -> int:
    """The data's ``shards`` made a whole number of waves on ``machines`` (every machine busy to
    a round's end): the nearest multiple, at least one wave, at most ``most`` (or one wave when
    the machines are more)."""
    if shards % machines == 0:
        return shards
    waves = max(1, round(shards / machines))
    while waves > 1 and waves * machines > most:
        waves -= 1
    return waves * machines


@dataclass(frozen=True)
class Given:
    """The options the user gave (None: the plan's to choose)."""

    codec: str | None = None
    broadcast_codec: str | None = None
    sync: str | None = None
    sync_every: int | None = None


@dataclass
class Plan:
    codec: str
    broadcast_codec: str
    sync: str
    sync_every: int
    shards: int
    outer_role: str  # "store": outer steps beside the store; "trainer": on a trainer
    predicted_utilisation: float | None  # None: no step time known (the plan is alike at any)
    round_s: float | None
    bytes_per_round: int
    why: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Prediction:
    round_s: float
    utilisation: float
    bytes_per_round: int


def outer_units(values: int, shards: int, codec: str, broadcast_codec: str) -> float:
    """The outer step's CPU work, in units of :data:`OUTER_S_PER_UNIT`: ``shards`` updates of
    ``values`` read in ``codec``, θ stepped, and its move encoded in ``broadcast_codec``."""
    return values * (shards * READ_UNITS[codec] + 1.0 + BROADCAST_UNITS[broadcast_codec])


def predict(values: int, machines: Sequence[Machine], step_s: float, shards: int, sync_every: int,
            sync: str, codec: str, broadcast_codec: str, outer_beside_store: bool,
            outer: OuterSide | None = None) -> Prediction:
    """The model of one steady round (module docstring): its seconds, the trainers' utilisation
    and the bytes it moves over the machines' links. ``step_s``: for a machine with none;
    ``outer``: what the agents that take the outer step measured."""
    trainers = list(machines) or [Machine("here")]
    up_bytes = values * BYTES_PER_VALUE[codec]
    down_bytes = values * BYTES_PER_VALUE[broadcast_codec]

    def rate(bps: float | None) -> float:
        return bps if bps and bps > 0 else LOOPBACK_BPS

    def rtt(m: Machine) -> float:
        return m.rtt_s if m.rtt_s is not None else LOOPBACK_RTT_S

    computes = [sync_every * (m.step_s or step_s) for m in trainers]
    fixed = [ROUND_TRIPS_PER_TASK * rtt(m) + TASK_OVERHEAD_S for m in trainers]
    ups = [up_bytes / rate(m.up_bps) for m in trainers]
    downs = [down_bytes / rate(m.down_bps) for m in trainers]
    blocking = sync in ("rounds", "backup")
    tasks = [c + f + (u + d if blocking else 0.0) for c, f, u, d in zip(computes, fixed, ups, downs)]
    # the shards go to the machines as they free up (waves when shards > machines)
    free, compute, taken = [0.0] * len(trainers), 0.0, [0] * len(trainers)
    for _ in range(shards):
        i = min(range(len(trainers)), key=lambda j: free[j] + tasks[j])
        free[i] += tasks[i]
        compute += computes[i]
        taken[i] += 1
    makespan = max(free)
    side = outer or OuterSide()
    outer_cpu = outer_units(values, shards, codec, broadcast_codec) * (side.s_unit or OUTER_S_PER_UNIT)
    # θ and its outer state (Nesterov's momentum; with a compressed broadcast its residual too)
    theta_and_state = values * 4.0 * (2 + (broadcast_codec != "fp32"))
    outer_in, outer_out = shards * up_bytes, theta_and_state + down_bytes  # read; written: θ', state, broadcast
    moved = shards * (up_bytes + down_bytes)
    if outer_beside_store:  # θ and the state read back where the last step left them (ahead.KeptFiles)
        stepping = outer_cpu + (outer_in + outer_out) / BESIDE_STORE_BPS
    else:  # on a trainer, over the slowest one's links (any trainer may take it: θ and state read too)
        outer_in += theta_and_state
        stepping = outer_cpu + max(outer_in / rate(m.down_bps) + outer_out / rate(m.up_bps) for m in trainers)
        moved += int(outer_in + outer_out)
    # beside the store, one agent steps and evaluates every round, one after the other
    serial = stepping + side.eval_s if outer_beside_store else 0.0
    if blocking:
        round_s = max(makespan + FIXED_ROUND_S + stepping, serial)
    else:
        chain = max(ups) + FIXED_ROUND_S + stepping + max(downs)
        # a machine's link carries each of its tasks' update (and broadcast) once a round: with
        # two waves, twice the bytes in the same round, whatever overlaps what
        links = max(max(n * u, n * d) for n, u, d in zip(taken, ups, downs))
        round_s = max(makespan, chain, links, serial)
    utilisation = compute / (len(trainers) * round_s) if round_s > 0 else 0.0
    return Prediction(round_s, min(utilisation, 1.0), int(moved))


def sample_worth(sync_every: int) -> float:
    """What a sample trained at H = ``sync_every`` is worth against one at :data:`WORTH_H`
    (1 up to it): on gpt2-small at batch 1, H = 25 matched one machine's loss per sample and H = 99
    needed twice its samples (BENCHMARKS §18), so (WORTH_H / H)^:data:`WORTH_EXPONENT`. One
    recipe's figure: it only weighs H against utilisation where no H reaches the target."""
    return min(1.0, (WORTH_H / max(sync_every, 1)) ** WORTH_EXPONENT)


def codec_pairs(given: Given) -> list[tuple[str, str]]:
    """The (up, down) codec pairs to try, fidelity first: by the most compressed of the two,
    then the two together, then compressing up first (the broadcast reaches every θ). A codec
    given fixes its side; ``--codec`` alone fixes the broadcast's too, as without a plan."""
    if given.codec and not given.broadcast_codec:
        return [(given.codec, given.codec)]
    ups = [given.codec] if given.codec else list(UP_CODECS)
    downs = [given.broadcast_codec] if given.broadcast_codec else list(DOWN_CODECS)

    def level(codec: str, ladder: tuple[str, ...]) -> int:
        return ladder.index(codec) if codec in ladder else 0

    pairs = [(u, d) for u in ups for d in downs]
    return sorted(pairs, key=lambda p: (max(level(p[0], UP_CODECS), level(p[1], DOWN_CODECS)),
                                        level(p[0], UP_CODECS) + level(p[1], DOWN_CODECS),
                                        level(p[1], DOWN_CODECS)))


def task_transfer_s(values: int, machines: Sequence[Machine], pair: tuple[str, str]) -> float:
    """Seconds a task's update up and broadcast down take over the slowest machine's links."""
    return max(values * (BYTES_PER_VALUE[pair[0]] / (m.up_bps or LOOPBACK_BPS)
                         + BYTES_PER_VALUE[pair[1]] / (m.down_bps or LOOPBACK_BPS)) for m in machines)


def links_bound(values: int, machines: Sequence[Machine], sync_every: int, step_s: float,
                pair: tuple[str, str]) -> bool:
    """Whether a task's transfers in the most faithful codec ``pair`` left weigh on a round of
    ``sync_every`` steps (over :data:`SMALL_COMM` of its compute, as the sync choice asks): the
    links set its pace."""
    compute = sync_every * max(m.step_s or step_s for m in machines)
    return task_transfer_s(values, machines, pair) > max(SMALL_COMM * compute, FIXED_ROUND_S)


def choose(values: int, machines: Sequence[Machine], step_s: float, bounds: Bounds, given: Given,
           outer_beside_store: bool, notes: Sequence[str] = (), outer: OuterSide | None = None) -> Plan:
    """The plan for a model of ``values`` float values trained by ``machines`` (a step takes
    ``step_s`` on a machine with no figure of its own), within ``bounds``, around ``given``
    (module docstring). ``notes``: sentences on the figures (what was not measured), put first
    in ``why``; ``outer``: what the agents that take the outer step measured (:func:`predict`)."""
    trainers = list(machines) or [Machine("here")]
    why = list(notes)
    h_data = given.sync_every or min(bounds.sync_every, bounds.max_sync_every)
    # a small model: the data's shards and H are kept (SMALL_ROUND_S)
    small = h_data * max(m.step_s or step_s for m in trainers) < SMALL_ROUND_S
    data_shards = bounds.shards
    if bounds.rows_per_step > 0 and not small:
        bounds = bounds.for_shards(fitted_shards(bounds.shards, len(trainers), bounds.max_shards))
        h_data = given.sync_every or min(bounds.sync_every, bounds.max_sync_every)
        if bounds.shards > len(trainers) and links_bound(values, trainers, h_data, step_s, codec_pairs(given)[0]):
            # every shard's update crosses its machine's links once a round: where the links
            # bound the round, one wave (a shard a machine) moves the fewest bytes for its compute
            bounds = bounds.for_shards(min(len(trainers), bounds.max_shards))
            h_data = given.sync_every or min(bounds.sync_every, bounds.max_sync_every)
    lo = min(bounds.sync_every, bounds.max_sync_every)
    hi = max(lo, min(MAX_PLANNED_SYNC_EVERY, bounds.max_sync_every))
    h_values = [h_data] if given.sync_every or small else list(range(lo, hi + 1))

    def run(sync: str, pair: tuple[str, str], h: int) -> Prediction:
        return predict(values, trainers, step_s, bounds.shards, h, sync, pair[0], pair[1], outer_beside_store,
                       outer)

    def smallest_h(sync: str, pair: tuple[str, str]) -> int | None:
        for h in h_values:  # utilisation grows with H: the first that reaches the target
            if run(sync, pair, h).utilisation >= TARGET_UTILISATION:
                return h
        return None

    pairs = codec_pairs(given)
    # 1. sync: are the round's transfers small against its compute?
    first = pairs[0]
    compute = h_data * max(m.step_s or step_s for m in trainers)
    transfer = task_transfer_s(values, trainers, first)
    links_limit = links_bound(values, trainers, h_data, step_s, first)
    speeds = [m.step_s or step_s for m in trainers]
    if given.sync:
        sync = given.sync
        why.append(f"sync {sync}: given")
    elif (max(speeds) > SPEED_SPREAD * min(speeds)
          # and the slowest machine's round outlasts the fastest's by more than a round's fixed
          # cost: steps of a few ms are noise-bound, their spread gains nothing to act on
          and h_data * (max(speeds) - min(speeds)) > FIXED_ROUND_S
          and (mixed := choose_for_speeds(speeds, bounds.shards))):
        sync = mixed
        why.append(f"sync {sync}: the machines' steps take {min(speeds):.3g}-{max(speeds):.3g} s "
                   f"(the mixed-speed rule, docs/benchmarks/mixed-speeds.md)")
    elif links_limit:
        sync = "overlap"
        why.append(f"sync overlap: a round's transfers at {first[0]} take {transfer:.1f} s against "
                   f"{compute:.1f} s of compute at H = {h_data}; overlapped, the next round trains "
                   f"while they go")
    else:
        sync = "rounds"
        why.append(f"sync rounds: a round's transfers at {first[0]} take {transfer:.2f} s against "
                   f"{compute:.2f} s of compute at H = {h_data}: too little to be worth hiding")
    # 2-3. of the codec pairs that reach the target, the one that does at the smallest H (the
    # most faithful of those): fewer local steps between averages cost far more per sample than
    # compressing the updates (BENCHMARKS §18: H = 25 matched the machine alone's loss per
    # sample, H = 99 needed twice its samples; a codec ≤ 1-2 %, §17b)
    reaching = [(h, i, pair) for i, pair in enumerate(pairs) if (h := smallest_h(sync, pair)) is not None]
    chosen: tuple[tuple[str, str], int] | None = None
    if reaching:
        h, _, pair = min(reaching)
        chosen = (pair, h)
    if chosen is None:
        # none reaches it: the pair and H that do the most useful work a second — utilisation
        # × what a sample is worth at that H (sample_worth) — and of the pairs within a tenth
        # of the best, the most faithful: fidelity is not traded for less
        def score(pair: tuple[str, str], h: int) -> float:
            return run(sync, pair, h).utilisation * sample_worth(h)

        def best_h_of(pair: tuple[str, str]) -> int:
            return max(h_values, key=lambda h: (score(pair, h), -h))

        best_h = {pair: best_h_of(pair) for pair in pairs}
        best = max(score(pair, best_h[pair]) for pair in pairs)
        pair = next(p for p in pairs if score(p, best_h[p]) >= best * (1 - SMALL_COMM))
        h = best_h[pair]
        chosen = (pair, h)
        if given.sync_every:
            why.append(f"H = {h}: given")
        elif not small:
            why.append(f"H = {h}: no H up to {hi} reaches utilisation {TARGET_UTILISATION}; the H "
                       f"that does the most useful work a second (utilisation × a sample's worth at "
                       f"that H: (25 / H)^{WORTH_EXPONENT:g}, benchmarks §18)")
        else:
            why.append(f"H = {h}: the data's, for a round of {compute:.2f} s of compute (under "
                       f"{SMALL_ROUND_S:.0f} s: a small model, whose round's fixed costs — ≈ "
                       f"{FIXED_ROUND_S:.0f} s and {ROUND_TRIPS_PER_TASK} round trips a task — "
                       f"weigh on any H the data allows)")
    else:
        h = chosen[1]
        why.append(f"H = {h}: given" if given.sync_every else
                   f"H = {h}: the smallest from the data's {lo} (at most {hi}) that keeps a "
                   f"predicted utilisation ≥ {TARGET_UTILISATION}")
    (up, down), h = chosen
    reached = run(sync, (up, down), h).utilisation >= TARGET_UTILISATION
    if given.codec:
        why.append(f"codec {up}: given" + ("" if given.broadcast_codec else ", and the broadcast's"))
    elif up == "fp32" and down == "fp32":
        why.append("codec fp32 both ways: the links carry whole-precision updates in time")
    else:
        what = ("the pair that reaches utilisation {t} at the smallest H (fewer local steps lose "
                "less per sample than the codec)" if reached else "none reaches utilisation {t}; the best")
        why.append(f"codec {up} up, {down} down: {what.format(t=TARGET_UTILISATION)} "
                   f"({values * BYTES_PER_VALUE[up] / 1e6:.1f} MB up a shard, "
                   f"{values * BYTES_PER_VALUE[down] / 1e6:.1f} MB down)")
    if given.broadcast_codec:
        why.append(f"broadcast codec {down}: given")
    # 4. shards against machines
    waves = math.ceil(bounds.shards / len(trainers))
    on = f"{len(trainers)} machine{'s' if len(trainers) > 1 else ''}"
    if bounds.shards != data_shards:
        links = (", where the links set the pace: each shard's update crosses them once a round"
                 if waves == 1 and fitted_shards(data_shards, len(trainers), bounds.max_shards) > bounds.shards
                 else "")
        why.append(f"shards {bounds.shards}, not the data's {data_shards}: {waves} whole "
                   f"wave{'s' if waves > 1 else ''} on {on}, none waiting for the others{links} "
                   f"(the model depends on the shards, so on this plan, never on which machines run them)")
    elif bounds.shards < len(trainers):
        why.append(f"shards {bounds.shards} on {on}: {len(trainers) - bounds.shards} wait each round")
    else:
        why.append(f"shards {bounds.shards} on {on}: {waves} wave{'s' if waves > 1 else ''} a round")
    # 5. the outer step
    if outer_beside_store:
        role = "store"
        why.append("outer steps beside the store: an agent there serves the outer queue")
    else:
        role = "trainer"
        cost = run(sync, (up, down), h).round_s - predict(values, trainers, step_s, bounds.shards, h,
                                                           sync, up, down, True, outer).round_s
        line = "outer steps on a trainer: no agent beside the store serves the outer queue"
        if cost > 0.05 * run(sync, (up, down), h).round_s:
            line += (f"; one there (`tensorturn agent --role outer` on the store's machine) would "
                     f"save ≈ {cost:.0f} s a round")
        why.append(line)
    final = run(sync, (up, down), h)
    return Plan(up, down, sync, h, bounds.shards, role, round(final.utilisation, 3),
                round(final.round_s, 2), final.bytes_per_round, why)
