"""``status``, ``runs`` (and ``runs rm``), ``report`` and ``workers``: looking at runs and machines."""

from __future__ import annotations

import sys
from typing import Any

import click

from tensorturn import config
from tensorturn.cli import cli, emit_json, pool_options
from tensorturn.cli.output import can_ask
from tensorturn.errors import BrokerError, TensorTurnError
from tensorturn.state.roster import WorkerState


class BrokerDownWarning:
    """What looking at runs does when the broker does not answer (the coordinator is stopped):
    one warning line, then the store is read, which holds every run's last saved state."""

    def __init__(self, store: str):
        self.store = store
        self.seen = False

    def __call__(self, exc: BrokerError) -> None:
        self.seen = True
        click.echo(config.mask_text(f"warning: {str(exc).rstrip('. ')}; reading the store "
                                    f"{config.mask_url(self.store)} instead"), err=True)


@cli.command()
@click.argument("run_id")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--watch", is_flag=True, help="Follow the run until it finishes.")
@click.option("--print-config", is_flag=True,
              help="Print the settings the run was started with as a run file (TOML), for "
                   "`tensorturn run --config`, and exit.")
@pool_options()
def status(broker, store, run_id, as_json, watch, print_config):
    """Show a run: state, metrics, rounds, attempts, the settings it ran with (from the broker,
    else the store).

    Exits 1 when the run failed. A run that made no progress for a while says why. With --debug,
    the traceback each failed task's last attempt recorded on its agent.
    """
    from tensorturn.cli.output import launched, print_result
    from tensorturn.runs.display import shown
    from tensorturn.runs.records import describe
    from tensorturn.spec import FINISHED

    down = BrokerDownWarning(store)
    doc = shown(describe(run_id, broker, store, on_broker_down=down))  # secret options masked
    ran_with = (doc.get("spec") or {}).get("run_config")
    if print_config:
        from tensorturn.runfile import dumps

        if not ran_with:
            raise TensorTurnError(f"run {run_id} keeps no run settings (it was not started by "
                                  f"`tensorturn run` or Pool.run of this version)")
        click.echo(dumps(ran_with), nl=False)
        return
    if watch and broker and not down.seen and doc["state"] not in FINISHED:
        from tensorturn.runs.launch import follow_on_pool

        doc = launched(lambda observer: follow_on_pool(broker, run_id, None, observer))
    from tensorturn.state.live import figure, figures

    details = []  # below the run's own lines
    for r in doc.get("rounds", []):
        val = figures(r, "val_")  # the recipe's own metrics, a regression's in the user's units
        details.append(f"  round {r['round']}: loss {figure(r['loss'])}" + (f"  {val}" if val else "")
                       + f"  bytes {r['bytes']}")
    if ran_with:  # what ran, as its run file holds it (--print-config writes that file)
        from tensorturn.runfile import ordered

        details.append("  ran with: " + " ".join(f"{k}={v}" for k, v in ordered(ran_with).items()))
    print_result(doc, as_json, details=details)


@cli.group(invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list.")
@pool_options()
def runs(broker, store, as_json):
    """List runs, newest first (the broker's, and the manifests in the store).

    \b
      tensorturn runs rm RUN      delete a finished run: its store objects and broker keys
    """
    if click.get_current_context().invoked_subcommand is not None:
        return
    from tensorturn.runs.records import list_runs

    items = list_runs(broker, store, on_broker_down=BrokerDownWarning(store))
    if as_json:
        emit_json(items)
        return
    if not items:
        click.echo("no runs")
    from tensorturn.state.live import figures

    for m in items:
        test = figures(m.get("metrics") or {}, "test_", brief=True)  # a regression's: loss, MAE…
        click.echo(f"{m['run_id']}  {m['mode']:8s} {m['state']:9s} {m['recipe']}"
                   + (f"  {test}" if test else "")
                   + (f"  ({m['note']})" if m.get("note") else ""))


@runs.command("rm")
@click.argument("run_id")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation (needed without a terminal).")
@click.option("--force", is_flag=True, help="Also remove a run whose manifest is not finished and "
              "that no broker record shows (a killed embedded run, say).")
@click.option("--json", "as_json", is_flag=True, help="Print what was deleted as one JSON object.")
@pool_options()
def runs_rm(broker, store, run_id, yes, force, as_json):
    """Delete a finished run: every object under runs/RUN/ in the store, and its keys on the
    broker. Refused while it runs (cancel it first), while a running run reads it, and while
    `tensorturn serve` serves it. Asks first, unless --yes.
    """
    from tensorturn.runs.records import remove_run

    def confirm(plan: dict[str, Any]) -> bool:
        if yes:
            return True
        if not can_ask():
            raise TensorTurnError(f"not removing run {run_id} without confirmation: no terminal "
                                  f"to ask on; pass --yes")
        return click.confirm(f"remove run {run_id} ({plan['state']}): {plan['objects']} objects, "
                             f"{_megabytes(plan['bytes'])} in the store, and its broker keys?",
                             default=False, err=True)

    removed = remove_run(run_id, broker, store, confirm, force=force)
    if removed is None:
        click.echo(f"run {run_id} not removed", err=True)
        sys.exit(1)
    if as_json:
        emit_json(removed)
        return
    click.echo(f"run {run_id} removed: {removed['objects']} objects ({_megabytes(removed['bytes'])}) "
               f"from the store, {removed['broker_keys']} keys from the broker")


def _megabytes(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


@cli.command()
@click.argument("run_id")
@click.option("--out", "out", metavar="DIR",
              help="Also write the files to this local folder (made if missing), e.g. to share report.html.")
@click.option("--json", "as_json", is_flag=True, help="Print the files' locations as a JSON list of URIs.")
@pool_options()
def report(broker, store, run_id, as_json, out):
    """Plot a run and write its report page, saved beside its manifest; prints where they are.

    PNGs: loss (with validation accuracy, per round and over time; per member for an ensemble),
    timeline (every task attempt per machine over time: failed, requeued, handed back, incidents),
    samples_per_worker, bytes (the model's, and per machine the store's and the dataset's).
    report.html holds them all with the run's summary, rounds or members, machines and what went
    wrong, as one self-contained file. Works on a running, finished or failed run.
    """
    from tensorturn.runs.records import describe

    # an unknown run fails before matplotlib loads
    doc = describe(run_id, broker, store, on_broker_down=BrokerDownWarning(store))
    from tensorturn.runs.report import save_report
    from tensorturn.store.objects import open_store

    uris = save_report(doc, open_store(store), out=out)
    if as_json:
        emit_json(uris)
        return
    for uri in uris:
        click.echo(uri)


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list.")
@click.option("--prune", is_flag=True,
              help="First prune the broker's leftovers now (as a finishing run does, at most "
                   "hourly): forget agents offline longer than TENSORTURN_AGENT_TTL_S and their "
                   "queues; expire keys finished or lost runs left.")
@pool_options()
def workers(broker, store, as_json, prune):
    """List the pool's machines: state (idle/busy/paused/offline/quarantined), device, memory, task,
    and their links: measured store rates against the owner's caps, broker round trip, data budget.

    An agent offline for longer than TENSORTURN_AGENT_TTL_S (a day) is forgotten.
    """
    from tensorturn.runs import records

    if not broker:
        raise TensorTurnError("`workers` needs a pool: pass --broker URL or set TENSORTURN_BROKER_URL")
    if prune:
        done = records.prune(broker)
        forgotten = done["agents_forgotten"]
        click.echo(f"pruned: {len(forgotten)} agent(s) forgotten"
                   + (f" ({', '.join(forgotten)})" if forgotten else "")
                   + f", {done['run_keys_expiring']} run key(s) given an expiry, "
                     f"{done['runs_unlisted']} gone run(s) unlisted", err=True)
    items = records.workers(broker)
    if as_json:
        emit_json(items)
        return
    if not items:
        click.echo("no workers have connected to this broker")
    else:
        click.echo(_worker_row("NAME", "STATE", "DEV", "DEVICE", "CPUS", "MEMORY", "DONE")
                   + "  DETAIL")
    for w in items:
        line = _worker_row(w["name"], w["state"], w["device"], w["device_name"], w["cpu_count"],
                           f"{w['device_memory_gb']:.1f} GB", w["tasks_done"])
        if w.get("role", "train") != "train":  # beside the store: takes the outer steps
            line += f"  role {w['role']}"
        if w["task"]:
            rate = w.get("samples_per_s")
            line += f"  {w['task']}" + (f" {rate:.0f} samples/s" if rate else "")
        if w.get("stopped"):
            ago = w.get("stopped_s")
            line += "  stopped" + (f" {_ago(ago)} ago" if ago is not None else "") + " (clean stop)"
        elif w["state"] == WorkerState.OFFLINE:
            line += f"  last seen {_ago(w['last_seen_s'])} ago (no clean stop)"
        if w["state"] == WorkerState.QUARANTINED:
            line += f"  ({w['quarantined']})"
        if w["state"] == WorkerState.PAUSED:
            line += f"  ({w['paused']})"
        if w["state"] != WorkerState.OFFLINE:
            line += f"  [{records.link_summary(w)}]"
        click.echo(line)
    total, refused = records.refusals(broker)
    if total:
        kept = f", the last {len(refused)} kept" if total > len(refused) else ""
        last = (f"; last: {refused[0].get('task')} on {refused[0].get('worker')}: "
                f"{refused[0].get('reason')}") if refused else ""
        click.echo(f"{total} task message(s) refused by the agents (see docs/trust.md{kept})"
                   f"{last}", err=True)


def _worker_row(name: object, state: object, device: object, device_name: object, cpus: object,
                memory: object, done: object) -> str:
    return (f"{str(name):28s} {str(state):11s} {str(device):4s} {str(device_name)[:32]:32s} "
            f"{str(cpus):>4s}  {str(memory):>9s}  {str(done):>5s}")


def _ago(seconds: float) -> str:
    """``seconds`` as a person reads an age: 42s, 7m, 3h, 2d."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:.0f}s"
