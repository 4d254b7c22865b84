"""Is it faster than my best machine alone? Time to a target validation loss: one machine training
the recipe by itself against three machines in a fused run at the defaults (no codec, sync or H
given: ``--plan auto`` chooses them from the links and steps it measures), on emulated home links,
a LAN, and a mixed pool.

Needs root for the pools (network namespaces; ``testbed/netlab.py``), as ``wan.py`` does: three
trainers each behind a link shaped by ``tc tbf`` with an RTT from a delay proxy in front of Redis
and the S3 endpoint (moto's server), and one agent ``--role outer`` beside the store.

**Time dilation.** A step of gpt2-small takes ≈ 1 s of real compute here, and three agents share
two cores, so a step cannot be emulated at 1 s. Every step lasts ``--sim-step`` S seconds instead
(``TESTBED_SIM_STEP_S``) and *everything that is time on the wire is stretched by the same
k = S ÷ ``--stands-for`` (1 s)*: link rates divided by k, the RTT multiplied by k. A run is then the
run on 1 s steps and the nominal links, slowed down k times — except what is CPU on the
coordinator (the outer step, evaluations) and per-task fixed costs, which are not stretched and so
weigh k times less than they would (said in BENCHMARKS). Figures in seconds are reported as
measured (dilated) and ÷ k.

Parts (``--parts``; each writes ``speedup_<part>.json`` under the results, the report reads them):

* ``alone`` — the best machine alone: the recipe's own training loop in this process (no agent,
  no store, no transfers — a baseline stricter than one agent), ``--steps`` AdamW steps over all
  the training rows, its validation loss every ``--eval-every`` steps; its wall is steps × S
  (emulated). Its final validation loss is the target.
* ``home`` — three trainers on ``--rates`` (20/100 Mbit/s), ``--rtt-ms`` (40), defaults, ``--rounds``;
  a three-round warm-up run first (:data:`WARM_UP`), so the agents have published their step
  times and the outer agent its outer step's rate, which the plan reads (as a pool that has run
  before has).
* ``home-picks`` — ``home``'s links, each ``--home-picks`` setting (codec/broadcast/sync/H).
* ``lan`` — the trainers and the outer agent on loopback and a file store (a LAN's rate or more:
  :func:`lan_part` says why not over emulated links): the defaults, then each ``--lan-picks``
  setting (codec/sync/H) at about the defaults' samples.
  (``speedup_home-before.json``: the ``home`` part as the plan before issue 49's last change chose;
  ``speedup_home-int2.json``: before the outer step was made faster and measured;
  ``speedup_home-no-read-ahead.json``: before the next broadcast was read ahead;
  ``speedup_home-probed-outer.json``: the outer step's transfers priced at its probed links;
  ``speedup_home-eval-unmodelled.json``: before the plan counted the outer agent's evaluations.)
* ``mixed`` — ``home``'s links, but the third machine 3× slower and the first one's link
  ``--mixed-up`` (5) Mbit/s up; the same warm-up first.

    python benchmarks/speedup.py [--parts alone,home,lan,mixed] [--steps 600] [--rounds 10]
    python benchmarks/speedup.py --report [--target-steps 600]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import RESULTS, figure, machine, run_job, table, write_outputs  # noqa: E402
from wan import real_step_s, recipe_options, settled, steady_utilisation, wire  # noqa: E402

TRAINERS = 3
# the run before the measured one, on the same pool: each agent publishes its step time, and the
# outer agent its outer step's rate and an evaluation's time from the first two rounds of three
# (overlapped, as the trainers train on the cores it shares with them here). At the data's H, as
# a run at the defaults would: at H = 10 the trainers waited more, and left the outer agent
# more of the two cores than a run does (its evaluation: 15 s there, 28 s in the run after)
WARM_UP = dict(rounds=3, sync_every=25, codec="ternary", broadcast_codec="int8", sync="overlap")


def dilation(args) -> float:
    return args.sim_step / args.stands_for


def alone(args) -> dict[str, Any]:
    """The recipe trained by one machine by itself: one AdamW optimizer over ``--steps`` steps of
    all the training rows, evaluated as a fused round is (the same validation passes)."""
    import torch

    from tensorturn.recipes import resolve
    from tensorturn.train.device import pick_device
    from tensorturn.train.diloco import initial_state
    from tensorturn.train.loop import load_model, set_threads, train_steps

    set_threads(os.cpu_count() or 1)
    recipe = resolve(args.recipe, args.options)
    device = pick_device()
    model = load_model(recipe, initial_state(recipe, args.seed), recipe.default_config(), device)
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay)
    x, y, rows = recipe.shard_data(0, 1, args.seed)

    def val() -> float:
        model.eval()
        with torch.no_grad():
            figures, _ = recipe.evaluate_counted(model, "val", device, args.eval_batches)
        model.train()
        return float(figures["loss"])

    curve = [{"steps": 0, "emulated_s": 0.0, "val_loss": val()}]
    done, started = 0, time.perf_counter()
    while done < args.steps:
        n = min(args.eval_every, args.steps - done)
        train_steps(recipe, model, opt, x, y, rows, n, args.batch, args.seed + done, device)
        done += n
        curve.append({"steps": done, "emulated_s": done * args.sim_step, "val_loss": val()})
        print(f"alone: {done}/{args.steps} steps, val loss {curve[-1]['val_loss']:.4f} "
              f"({time.perf_counter() - started:.0f} s real)", flush=True)
    return {"part": "alone", "steps": args.steps, "wall_s": args.steps * args.sim_step,
            "val_loss": curve[-1]["val_loss"], "curve": curve}


def links(spec: str) -> tuple[float, float]:
    up, down = (float(v) for v in spec.split("/"))
    return up, down


def fused_row(pool, store: str, args, label: str, target: float | None, **given: Any) -> dict[str, Any]:
    """One fused run on ``pool``, with only ``given`` of codec, sync and H (the rest planned)."""
    from tensorturn.runs.records import remove_run

    k = dilation(args)
    links_of = hasattr(pool, "links")  # a LinkPool's links count their bytes; loopback none
    before = wire(pool) if links_of else (0, 0)
    submitted = time.time()
    doc = run_job(pool, store, timeout_s=7200, recipe=args.recipe, recipe_options=args.options,
                  mode="fused", rounds=given.pop("rounds", args.rounds), batch_size=args.batch,
                  threads_per_task=1, eval_batches=args.eval_batches, seed=args.seed, **given)
    doc = settled(pool, doc["run_id"])
    after = wire(pool) if links_of else (0, 0)
    plan = doc["spec"]["options"].get("planned") or {}  # the plan kept in the spec
    remove_run(doc["run_id"], pool.broker_url, store)  # moto holds objects in memory
    h = int(plan.get("sync_every") or given.get("sync_every") or doc["rounds"][0]["samples"] // args.batch)
    sync = plan.get("sync") or given.get("sync")
    ats = [a for a in doc["attempts"] if a["finished_at"]]
    start = min(a["started_at"] for a in ats)
    span = max(a["finished_at"] for a in ats) - start
    steps = sum(int(r["samples"]) for r in doc["rounds"]) // args.batch
    curve = [{"round": i + 1, "samples_steps": sum(int(x["samples"]) for x in doc["rounds"][:i + 1]) // args.batch,
              "s": r["at"] - submitted, "val_loss": r.get("val_loss")} for i, r in enumerate(doc["rounds"])]
    reached = [p for p in curve if target is not None and p["val_loss"] is not None and p["val_loss"] <= target]
    steady = steady_utilisation(doc, sync, h * args.sim_step) if sync else None
    row = {"part": label, "given": dict(given), "plan": plan, "H": h, "sync": sync,
           "codec": plan.get("codec") or given.get("codec"),
           "broadcast_codec": plan.get("broadcast_codec") or given.get("broadcast_codec"),
           "rounds": len(doc["rounds"]), "steps": steps, "wall_s": doc["rounds"][-1]["at"] - submitted,
           "tasks_span_s": span, "utilisation": steps * args.sim_step / (TRAINERS * span),
           # a shard's compute ÷ its period, × the shards each machine trains a round (waves)
           "steady_utilisation": steady * max(1, int(plan.get("shards") or TRAINERS) // TRAINERS)
           if steady is not None else None,
           "predicted_utilisation": plan.get("predicted_utilisation"),
           "val_loss": doc["rounds"][-1]["val_loss"], "curve": curve,
           "to_target_s": reached[0]["s"] if reached else None,
           "wire_up": after[0] - before[0], "wire_down": after[1] - before[1], "dilation": k}
    print({k_: v for k_, v in row.items() if k_ not in ("curve", "plan")}, flush=True)
    return row


def measured_links(pool, timeout_s: float = 300) -> None:
    """Wait until every trainer's heartbeat carries its measured links (each agent probes its
    link as it starts; a run submitted before would plan with them taken as loopback)."""
    from tensorturn.modes.fused.measured import link_figures
    from tensorturn.state.broker import redis_client

    client = redis_client(pool.broker_url)
    deadline = time.monotonic() + timeout_s
    while True:
        figures = link_figures(client)
        trainers = [f"local{i + 1}" for i in range(TRAINERS)]
        if all(any(name.startswith(t + "@") and f["up_bps"] and f["down_bps"] for name, f in figures.items())
               for t in trainers):
            print({name: (round(f["up_bps"] * 8 / 1e6, 1), round(f["down_bps"] * 8 / 1e6, 1))
                   for name, f in figures.items() if f["up_bps"]}, "Mbit/s measured", flush=True)
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the trainers' links were not measured within {timeout_s:.0f} s: {figures}")
        time.sleep(1)


def lan_part(args, target: float | None) -> list[dict[str, Any]]:
    """Three trainers and an outer agent on this machine's loopback and file store (fsynced:
    55-480 MB/s as the agents measure it, a LAN's rate or more): the defaults, then each
    ``--lan-picks`` setting at the defaults' samples. Not over emulated links: at a LAN's rate moto
    and the delay proxy, in Python on the same two cores, starve the agents (their leases lapse)."""
    from tensorturn.pool.embedded import LocalPool

    os.environ["TESTBED_SIM_STEP_S"] = str(args.sim_step)
    rows: list[dict[str, Any]] = []
    try:
        with tempfile.TemporaryDirectory(prefix="tt-speedup-") as tmp:
            store = f"file://{tmp}/store"
            with LocalPool(TRAINERS + 1, store, workdir=Path(tmp), roles=["train"] * TRAINERS + ["outer"],
                           allow=(args.recipe,)) as pool:
                measured_links(pool)
                rows.append(fused_row(pool, store, args, "lan", target, rounds=args.lan_rounds))
                for pick in filter(None, args.lan_picks.split(",")):
                    codec, sync, h = pick.split("/")
                    rounds = max(1, round(rows[0]["steps"] / (TRAINERS * int(h))))
                    rows.append(fused_row(pool, store, args, f"lan {pick}", target, rounds=rounds,
                                          codec=codec, sync=sync, sync_every=int(h)))
    finally:
        os.environ.pop("TESTBED_SIM_STEP_S", None)
    for row in rows:
        row.update(rate="loopback (file store)", rtt_ms=None)
    return rows


def pool_dir(args) -> Any:
    """The pool's working folder: removed at the end, or with ``--keep-pool DIR`` kept there (the
    agents' logs at INFO, Redis's, the spool) to read what happened after a run."""
    if not args.keep_pool:
        return tempfile.TemporaryDirectory(prefix="tt-speedup-")
    Path(args.keep_pool).mkdir(parents=True, exist_ok=True)
    return contextlib.nullcontext(tempfile.mkdtemp(prefix="tt-speedup-", dir=args.keep_pool))


def pool_part(part: str, args, target: float | None) -> list[dict[str, Any]]:
    from tensorturn.pool.embedded import stop_process_group
    from testbed import netlab
    from testbed.s3 import start_moto

    k = dilation(args)
    rate, rtt = args.rates, args.rtt_ms
    up, down = links(rate)
    link_rates = [(up / k, down / k)] * TRAINERS
    steps = [args.sim_step] * TRAINERS
    if part == "mixed":
        link_rates[0] = (args.mixed_up / k, down / k)
        steps[-1] = args.sim_step * args.mixed_slow
    print(f"\n== {part}: links {rate} Mbit/s, RTT {rtt:g} ms (stretched ×{k:g}: "
          f"{[f'{u:g}/{d:g}' for u, d in link_rates]}, {rtt * k:g} ms), steps {steps} s ==", flush=True)
    moto, store_env = start_moto()
    os.environ.update(store_env)
    os.environ["TESTBED_SIM_STEP_S"] = str(args.sim_step)
    rows: list[dict[str, Any]] = []
    try:
        import boto3

        boto3.client("s3").create_bucket(Bucket="tt-speedup")
        store = "s3://tt-speedup/runs"
        with pool_dir(args) as tmp, \
                netlab.LinkPool(TRAINERS, store, store_env, rtt_ms=rtt * k, workdir=Path(tmp),
                                outer_agent=True, allow=(args.recipe,), link_rates=link_rates,
                                agent_env=[{"TESTBED_SIM_STEP_S": str(s)} for s in steps],
                                loglevel="INFO" if args.keep_pool else "WARNING") as pool:
            measured_links(pool)
            if part in ("home", "mixed"):  # a pool that has run before: its step times and outer rate published
                fused_row(pool, store, args, f"{part} warm-up", None, **WARM_UP)
            if part == "home-picks":  # settings by hand on the home links (codec/broadcast/sync/H)
                for pick in filter(None, args.home_picks.split(",")):
                    codec, broadcast, sync, h = pick.split("/")
                    rows.append(fused_row(pool, store, args, f"home {pick}", target, rounds=args.pick_rounds,
                                          codec=codec, broadcast_codec=broadcast, sync=sync, sync_every=int(h)))
            else:
                rows.append(fused_row(pool, store, args, part, target, rounds=args.rounds))
    finally:
        os.environ.pop("TESTBED_SIM_STEP_S", None)
        stop_process_group(moto, grace=5)
    for row in rows:
        row.update(rate=rate, rtt_ms=rtt)
    return rows


def path_of(part: str, args) -> Path:
    return Path(args.out_dir or RESULTS) / f"speedup_{part}.json"


def report(args) -> None:
    names = ("alone", "home-before", "home-int2", "home-no-read-ahead", "home-probed-outer",
             "home-eval-unmodelled", "home", "home-picks", "lan", "mixed")
    parts = {p: json.loads(path_of(p, args).read_text()) for p in names if path_of(p, args).exists()}
    if "alone" not in parts:
        sys.exit("speedup.py: no speedup_alone.json: run --parts alone first")
    base = parts["alone"]["rows"][0]
    budget = args.target_steps or base["steps"]
    at_budget = [p for p in base["curve"] if p["steps"] <= budget][-1]
    target, alone_wall = at_budget["val_loss"], at_budget["emulated_s"]
    rows = [r for p in names[1:] if p in parts for r in parts[p]["rows"]]
    k = parts["alone"]["args"]["sim_step"] / parts["alone"]["args"]["stands_for"]
    print(f"\nthe machine alone: {at_budget['steps']} steps, {alone_wall:.0f} s emulated "
          f"({alone_wall / k:.0f} s at 1 s a step), val loss {target:.4f} (the target)\n")
    for r in rows:  # the time to the target, again from the rounds' curve (the parts may predate it)
        reached = [p for p in r["curve"] if p["val_loss"] is not None and p["val_loss"] <= target]
        r["to_target_s"] = reached[0]["s"] if reached else None

    def alone_at(steps: int) -> float | None:
        """The machine alone's validation loss at its last evaluation within ``steps``."""
        points = [p for p in base["curve"] if p["steps"] <= steps]
        return points[-1]["val_loss"] if points and steps <= base["steps"] else None

    def alone_to(loss: float) -> float | None:
        """Emulated seconds the machine alone took to a validation loss this low (None: never)."""
        return next((p["emulated_s"] for p in base["curve"] if p["val_loss"] <= loss), None)

    for r in rows:  # each round's weights: when alone reached their loss, against when they did
        for p in r["curve"]:
            p["alone_s"] = alone_to(p["val_loss"]) if p["val_loss"] is not None else None
            p["speedup"] = p["alone_s"] / p["s"] if p["alone_s"] else None
        speedups = [p["speedup"] for p in r["curve"] if p["speedup"]]
        r["best_speedup"] = max(speedups) if speedups else None
        print(f"{r['part']}: " + "; ".join(
            f"round {p['round']} {p['s']:.0f} s, val {p['val_loss']:.4f}, alone there at "
            + (f"{p['alone_s']:.0f} s ({p['speedup']:.2f}×)" if p["alone_s"] else "— (not within its steps)")
            for p in r["curve"] if p["val_loss"] is not None))

    def num(v: float | None, fmt: str = ".3f") -> str:
        return format(v, fmt) if v is not None else "—"

    print(table(["pool", "links Mbit/s", "plan (codec up/down, sync, H)", "rounds", "steps",
                 "predicted utilisation", "steady utilisation", "to target s (÷ k)", "speed-up",
                 "best speed-up at a round's loss",
                 "val loss", "alone's at equal steps", "wire up MB", "wire down MB"],
                [[r["part"], r["rate"], f"{r['codec']}/{r['broadcast_codec']}, {r['sync']}, {r['H']}",
                  r["rounds"], r["steps"], num(r["predicted_utilisation"]), num(r["steady_utilisation"]),
                  f"{r['to_target_s']:.0f} ({r['to_target_s'] / k:.0f})" if r["to_target_s"] else "not reached",
                  f"{alone_wall / r['to_target_s']:.2f}×" if r["to_target_s"] else "—",
                  f"{r['best_speedup']:.2f}×" if r["best_speedup"] else "—",
                  f"{r['val_loss']:.4f}", num(alone_at(r["steps"]), ".4f"),
                  f"{r['wire_up'] / 1e6:.0f}", f"{r['wire_down'] / 1e6:.0f}"] for r in rows]))
    summary = {"machine": machine(), "alone": base, "target": {"steps": at_budget["steps"], "val_loss": target,
               "emulated_s": alone_wall}, "rows": rows, "dilation": k}
    write_outputs("speedup", summary, draw(base, rows, k, target), Path(args.out_dir) if args.out_dir else None)


def draw(base: dict[str, Any], rows: list[dict[str, Any]], k: float, target: float) -> Any:
    fig = figure(8, 4.5)
    ax = fig.subplots()
    ax.plot([p["emulated_s"] / k for p in base["curve"]], [p["val_loss"] for p in base["curve"]],
            "k-", label="one machine alone")
    for i, r in enumerate(rows):
        pts = [p for p in r["curve"] if p["val_loss"] is not None]
        ax.plot([p["s"] / k for p in pts], [p["val_loss"] for p in pts], "o-", color=f"C{i}",
                label=f"3 machines, {r['part']} ({r['codec']}/{r['broadcast_codec']}, {r['sync']}, H {r['H']})")
    ax.axhline(target, color="grey", ls=":", lw=1)
    lowest = min([p["val_loss"] for p in base["curve"]]
                 + [p["val_loss"] for r in rows for p in r["curve"] if p["val_loss"] is not None])
    ax.set_ylim(lowest - 0.1, lowest + 1.3)  # the first evaluations (≈ 5.7 at θ_0) off the top
    ax.set_xlabel("seconds at 1 s a step (measured ÷ the dilation)")
    ax.set_ylabel("validation loss")
    ax.legend(fontsize=7)
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="alone,home,lan,mixed")
    parser.add_argument("--report", action="store_true", help="the table and chart from the parts' JSON")
    parser.add_argument("--recipe", default="gpt2-small")
    parser.add_argument("--recipe-option", action="append", default=[], metavar="KEY=VALUE",
                        help="the recipe's options (gpt2-small: context=32 unless given)")
    parser.add_argument("--steps", type=int, default=600, help="the machine alone's steps")
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--target-steps", type=int, default=0,
                        help="--report: the target is the machine alone's loss at this many steps (0: all)")
    parser.add_argument("--rounds", type=int, default=10, help="the home and mixed runs' rounds")
    parser.add_argument("--sim-step", type=float, default=2.0, help="emulated seconds a step lasts")
    parser.add_argument("--stands-for", type=float, default=1.0,
                        help="the step it stands for (s): links and RTT stretched by sim-step ÷ this")
    parser.add_argument("--rates", default="20/100")
    parser.add_argument("--rtt-ms", type=float, default=40)
    parser.add_argument("--lan-rounds", type=int, default=4, help="the LAN's defaults run's rounds")
    parser.add_argument("--lan-picks", default="fp32/rounds/25",
                        help="hand-picked codec/sync/H settings run on the LAN, comma-separated")
    parser.add_argument("--home-picks", default="ternary/int2/overlap/25",
                        help="--parts home-picks: codec/broadcast codec/sync/H settings on the home links")
    parser.add_argument("--pick-rounds", type=int, default=10, help="the home picks' rounds")
    parser.add_argument("--mixed-up", type=float, default=5, help="the mixed pool's slow uplink, Mbit/s")
    parser.add_argument("--mixed-slow", type=float, default=3, help="the mixed pool's slow machine: × the step")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default=None)
    parser.add_argument("--keep-pool", default=None, metavar="DIR",
                        help="keep the home/mixed pools' folders under DIR, agents logging at INFO")
    args = parser.parse_args()
    # a stopped benchmark stops its pool (agents are process groups of their own, 2+ GB each here)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.options = recipe_options(args.recipe_option or (["context=32"] if args.recipe == "gpt2-small" else []))
    if args.report:
        report(args)
        return
    for part in args.parts.split(","):
        if part == "alone":
            rows = [alone(args)]
        else:
            from testbed import netlab

            if why := netlab.unavailable():
                sys.exit(f"speedup.py: {why}")
            real = real_step_s(args.recipe, args.options, args.batch) * max(1.0, TRAINERS / (os.cpu_count() or 1))
            print(f"a real {args.recipe} step here: {real:.3f} s with {TRAINERS} agents sharing the cores", flush=True)
            if real * 1.2 > args.sim_step:
                sys.exit(f"speedup.py: the emulated step ({args.sim_step} s) is not longer than a real one "
                         f"here ({real:.3f} s, +20 %): pass --sim-step {math.ceil(real * 15) / 10}")
            alone_path = path_of("alone", args)
            target = json.loads(alone_path.read_text())["rows"][0]["val_loss"] if alone_path.exists() else None
            rows = lan_part(args, target) if part == "lan" else pool_part(part, args, target)
        out = path_of(part, args)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"machine": machine(), "args": vars(args), "rows": rows}, indent=1, default=str))
        print(f"wrote {out}", flush=True)


if __name__ == "__main__":
    main()
