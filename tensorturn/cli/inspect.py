"""``status``, ``runs``, ``report`` and ``workers``: looking at runs and machines."""

from __future__ import annotations

import click

from .. import config
from ..errors import BrokerError, TensorTurnError
from . import cli, emit_json, pool_options


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
@pool_options()
def status(broker, store, run_id, as_json, watch):
    """Show a run: state, metrics, rounds, attempts (from the broker, else the store).

    Exits 1 when the run failed. A run that made no progress for a while says why. With --debug,
    the traceback each failed task's last attempt recorded on its agent.
    """
    from .. import client
    from ..spec import FINISHED
    from .run import print_result

    down = BrokerDownWarning(store)
    doc = client.describe(run_id, broker, store, on_broker_down=down)
    if watch and broker and not down.seen and doc["state"] not in FINISHED:
        from .run import follow_pool

        doc = follow_pool(broker, run_id, None)
    if not as_json:
        for r in doc.get("rounds", []):
            acc = r.get("val_accuracy")
            val = r.get("val_loss")
            click.echo(f"  round {r['round']}: loss {r['loss']:.4f}"
                       + (f" val_loss {val:.4f}" if val is not None else "")
                       + (f" val_acc {acc:.3f}" if acc is not None else "") + f" bytes {r['bytes']}")
    print_result(doc, as_json)


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list.")
@pool_options()
def runs(broker, store, as_json):
    """List runs, newest first (the broker's, and the manifests in the store)."""
    from .. import client

    items = client.list_runs(broker, store, on_broker_down=BrokerDownWarning(store))
    if as_json:
        emit_json(items)
        return
    if not items:
        click.echo("no runs")
    for m in items:
        acc = (m.get("metrics") or {}).get("test_accuracy")
        click.echo(f"{m['run_id']}  {m['mode']:8s} {m['state']:9s} {m['recipe']}"
                   + (f"  test_accuracy {acc:.4f}" if acc is not None else "")
                   + (f"  ({m['note']})" if m.get("note") else ""))


@cli.command()
@click.argument("run_id")
@click.option("--json", "as_json", is_flag=True, help="Print the plots' locations as JSON.")
@pool_options()
def report(broker, store, run_id, as_json):
    """Plot a run (loss per round or member, samples/s per worker, bytes moved) as PNG files
    saved beside its manifest; prints where they are."""
    from .. import client

    # an unknown run fails before matplotlib loads
    doc = client.describe(run_id, broker, store, on_broker_down=BrokerDownWarning(store))
    from ..report import save_report
    from ..store import open_store

    uris = save_report(doc, open_store(store))
    if as_json:
        emit_json(uris)
        return
    for uri in uris:
        click.echo(uri)


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list.")
@pool_options()
def workers(broker, store, as_json):
    """List the pool's machines: state (idle/busy/offline/quarantined), device, memory, task."""
    from .. import client

    if not broker:
        raise TensorTurnError("`workers` needs a pool: pass --broker URL or set TENSORTURN_BROKER_URL")
    items = client.workers(broker)
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
        elif w["state"] == "offline":
            line += f"  last seen {_ago(w['last_seen_s'])} ago (no clean stop)"
        if w["state"] == "quarantined":
            line += f"  ({w['quarantined']})"
        click.echo(line)
    refused = client.refused(broker)
    if refused:
        last = refused[0]
        click.echo(f"{len(refused)} task message(s) refused by the agents (see README, \"Trust model\"); "
                   f"last: {last['task']} on {last['worker']}: {last['reason']}", err=True)


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
