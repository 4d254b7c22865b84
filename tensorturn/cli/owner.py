"""``pause``, ``unpause`` and ``rules``: a machine's owner comes first
(:mod:`tensorturn.pool.owner`). Older names still work: ``policy MACHINE`` for ``rules`` (a
"policy" is a fused run's sync policy now), and ``resume MACHINE`` for ``unpause``
(:mod:`tensorturn.cli.run`, with a note: ``resume`` is a run's verb)."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable

import click

from tensorturn.cli import cli, emit_json, pool_options
from tensorturn.errors import TensorTurnError

MACHINE = click.argument("machine", metavar="MACHINE")


def rules_options(fn: Callable) -> Callable:
    """The owner's rules as flags, shared by ``agent`` (its rules from the start) and ``rules``."""
    for decorate in reversed((
        click.option("--hours", default=None, metavar="HH:MM-HH:MM",
                     help="Work only in these local hours, e.g. 22:00-08:00 (ranges comma-separated; "
                          "a range may pass midnight)."),
        click.option("--pause-on-battery", is_flag=True, default=None,
                     help="Pause while the machine runs on battery."),
        click.option("--pause-when-busy", type=click.FloatRange(0, 100), default=None, metavar="PERCENT",
                     help="Pause while other processes use more than PERCENT of the CPU (a game, a "
                          "build), for 2 s in a row; resume after 5 s under it. 0: never."),
        click.option("--pause-when-gpu-shared", is_flag=True, default=None,
                     help="Pause while another process uses the GPU (NVIDIA: nvidia-smi)."),
        click.option("--max-upload-mbit", type=click.FloatRange(min=0), default=None, metavar="MBIT",
                     help="Upload to the store at most this fast, Mbit/s (a video call at home keeps "
                          "working). 0: no cap."),
        click.option("--max-download-mbit", type=click.FloatRange(min=0), default=None, metavar="MBIT",
                     help="Download from the store at most this fast, Mbit/s. 0: no cap."),
        click.option("--data-cap-gb", default=None, metavar="GB/PERIOD",
                     help="Move at most this much through the store per day, week or month, e.g. "
                          "200/month (GB = 10^9 bytes); past it, pause until the next period."),
    )):
        fn = decorate(fn)
    return fn


def unpause_machine(broker: str, machine: str, as_json: bool) -> None:
    """`tensorturn unpause MACHINE`: end the machine's pause (its rules — hours, battery, a busy
    CPU — may still hold it)."""
    from tensorturn.runs import owners

    doc = owners.unpause(broker, machine)
    if as_json:
        emit_json(doc)
    elif doc["was_paused"]:
        click.echo(f"{doc['machine']} resumes within a few seconds, unless its rules hold it")
    else:
        click.echo(f"{doc['machine']} was not paused by `tensorturn pause` (its rules may hold it: "
                   f"see `tensorturn workers`)")


def _need(broker: str | None, what: str) -> str:
    if not broker:
        raise TensorTurnError(f"`{what}` needs a pool: pass --join-file JOIN or --broker URL")
    return broker


@cli.command()
@MACHINE
@click.option("--reason", default="", help="Why (shown by `workers` and `status`).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@pool_options()
def pause(broker, store, machine, reason, as_json):
    """Pause MACHINE's agent: its running training task goes back to the queue within a few
    seconds (another machine redoes it, at no cost to the run's attempts), and it takes nothing
    until `tensorturn unpause MACHINE` — also across a restart of the agent.

    MACHINE is the agent's name as `workers` lists it (NAME@host), or NAME alone.
    """
    from tensorturn.runs import owners

    doc = owners.pause(_need(broker, "pause"), machine, reason)
    if as_json:
        emit_json(doc)
    else:
        click.echo(f"{doc['machine']} pauses within a few seconds ({doc['paused']}); "
                   f"`tensorturn unpause {machine}` ends it")


@cli.command()
@MACHINE
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@pool_options()
def unpause(broker, store, machine, as_json):
    """End MACHINE's pause (`tensorturn pause MACHINE`): it takes tasks again within a few
    seconds, unless its rules (hours, battery, a busy CPU or GPU) hold it.

    MACHINE is the agent's name as `workers` lists it (NAME@host), or NAME alone.
    """
    unpause_machine(_need(broker, "unpause"), machine, as_json)


@cli.command()
@MACHINE
@rules_options
@click.option("--clear", is_flag=True, help="Back to the rules the agent was started with.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@pool_options()
def rules(broker, store, machine, hours, pause_on_battery, pause_when_busy, pause_when_gpu_shared,
          max_upload_mbit, max_download_mbit, data_cap_gb, clear, as_json):
    """Set MACHINE's owner rules while its agent runs (they replace those the agent was started
    with, until --clear): the hours it may work, and when it steps aside for its owner.

    \b
      tensorturn rules gaming-pc --hours 22:00-08:00 --pause-when-busy 30
      tensorturn rules laptop --pause-on-battery
      tensorturn rules desktop --max-upload-mbit 20 --data-cap-gb 200/month
    """
    from tensorturn.pool.owner import OwnerRules
    from tensorturn.runs import owners

    given = (hours, pause_on_battery, pause_when_busy, pause_when_gpu_shared, max_upload_mbit,
             max_download_mbit, data_cap_gb)
    if clear and any(v is not None for v in given):
        raise click.UsageError("--clear goes alone: it drops the rules set here")
    if not clear and all(v is None for v in given):
        raise click.UsageError("say what the rules are (--hours, --pause-on-battery, --pause-when-busy, "
                               "--pause-when-gpu-shared, --max-upload-mbit, --max-download-mbit, "
                               "--data-cap-gb), or --clear")
    rule = None if clear else OwnerRules(hours=hours, on_battery=bool(pause_on_battery),
                                         busy_percent=pause_when_busy or 0.0,
                                         gpu_shared=bool(pause_when_gpu_shared),
                                         max_upload_mbit=max_upload_mbit or 0.0,
                                         max_download_mbit=max_download_mbit or 0.0,
                                         data_cap=data_cap_gb or "")
    doc = owners.set_rules(_need(broker, "rules"), machine, None if rule is None else rule.to_json())
    if as_json:
        emit_json({**doc, "policy": None if rule is None else json.loads(rule.to_json())})
    else:
        click.echo(f"{doc['machine']}: " + ("back to the rules it was started with" if rule is None
                                            else rule.describe()) + " (within a second)")


# `tensorturn policy MACHINE ...`, the command's name before "policy" was left to the sync policies
policy = copy.copy(rules)
policy.hidden = True
cli.add_command(policy, "policy")
