"""``agent`` and ``up``: joining a machine to the pool, and running the coordinator."""

from __future__ import annotations

from typing import Any

import click

from tensorturn import config
from tensorturn.cli import cli, debug_option, pool_options, stop_on_signals
from tensorturn.cli.owner import rules_options
from tensorturn.errors import TensorTurnError


def agent_flags(settings: config.Settings, broker: str | None, options: dict[str, Any]) -> config.Settings:
    """What ``agent`` was told on its command line overrides the environment, for this process
    and its pool (:func:`tensorturn.cli.pool_options` applies it once, at the start)."""
    def given(option: str, field: str) -> Any:
        return getattr(settings, field) if options[option] is None else options[option]

    return settings.with_(broker_url=broker,
                          device_memory_gb=options["memory_gb"] or settings.device_memory_gb,
                          cache_gb=options["cache_gb"] or settings.cache_gb,
                          role=options["role"] or settings.role,
                          agent_pool=options["pool"] or settings.agent_pool,
                          hours=given("hours", "hours"),
                          pause_on_battery=int(given("pause_on_battery", "pause_on_battery")),
                          pause_busy_percent=float(given("pause_when_busy", "pause_busy_percent")),
                          pause_gpu_shared=int(given("pause_when_gpu_shared", "pause_gpu_shared")),
                          max_upload_mbit=float(given("max_upload_mbit", "max_upload_mbit")),
                          max_download_mbit=float(given("max_download_mbit", "max_download_mbit")),
                          data_cap_gb=given("data_cap_gb", "data_cap_gb"))


@cli.command()
@click.option("--join", "join", metavar="-", envvar="TENSORTURN_JOIN",
              help="`-`: read the join string (the join file's one line) from stdin, at a hidden "
                   "prompt on a terminal (env TENSORTURN_JOIN also holds it). Never the string "
                   "itself here: a command line shows in `ps` and shell history.")
@click.option("--name", default=None, help="Worker name (shown as NAME@host) [default: agent].")
@click.option("--concurrency", type=click.IntRange(min=1), default=1, show_default=True,
              help="Tasks at once on this machine. One is right for a GPU and for CPUs "
                   "(each CPU task uses --threads-per-task threads).")
@click.option("--memory-gb", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Offer at most this much device memory (VRAM, or RAM on CPU) to the pool.")
@click.option("--cache-gb", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Disk for cached dataset chunks (least recently used go first) "
                   "[default: TENSORTURN_CACHE_GB or 4].")
@click.option("--role", type=click.Choice(["train", "outer", "both"]), default=None,
              help="What this machine takes: training tasks (train), the runs' outer steps "
                   "(outer: averaging, the outer optimizer, evaluation — they move whole models "
                   "through the store, so run one on the machine that holds it), or both "
                   "[default: TENSORTURN_ROLE or train].")
@click.option("--loglevel", default=None, help="Celery log level [default: INFO].")
@click.option("--pool", type=click.Choice(["prefork", "threads"]), default=None,
              help="How tasks run: in forked pool processes (prefork) or on a thread of the agent's "
                   "own process (threads) [default: TENSORTURN_AGENT_POOL, else prefork on Linux, "
                   "threads on Windows and macOS, which cannot fork a process that loaded torch].")
@rules_options
@pool_options(flags=agent_flags)
def agent(broker, store, name, concurrency, memory_gb, cache_gb, role, loglevel, pool, hours,
          pause_on_battery, pause_when_busy, pause_when_gpu_shared, max_upload_mbit, max_download_mbit,
          data_cap_gb):
    """Run this machine's agent: a Celery worker that trains what the pool queues.

    \b
    Join a pool with the file `tensorturn up` wrote (copy it over, e.g. with scp):
      tensorturn agent --join-file join --name gaming-pc
    or paste the join string at a hidden prompt: tensorturn agent --join -

    It only opens outbound connections, to the broker and the store, reconnects forever when the
    network drops, and on SIGTERM puts its running task back in the queue within a few seconds.
    It runs only work signed with the pool key, from its own store, and imports only built-in
    recipes and those allowed with --allow-recipe.

    \b
    On the coordinator (beside the store), take the outer steps off the home links:
      tensorturn agent --join-file .tensorturn/join --name coordinator --role outer
    If that agent goes away, the trainers take the outer steps again within a few heartbeats.

    
    The owner comes first: a gaming PC that trains at night, a laptop that stops on battery:
      tensorturn agent --join-file join --name gaming-pc --hours 22:00-08:00 --pause-when-busy 30
    Paused, it hands its running task back within a few seconds and takes nothing new until its
    rules allow; `tensorturn pause/unpause/rules MACHINE` change it from any machine.
    The household's line comes first too:
      tensorturn agent --join-file join --max-upload-mbit 20 --data-cap-gb 200/month
    """
    import os

    # SIGTERM (systemd, Ctrl-C of a supervisor) becomes Celery's cold shutdown with a short soft
    # grace: running tasks get a few seconds, then their messages go straight back to the queue.
    # billiard reads this when first imported, so it is set before anything imports Celery.
    from tensorturn import platforms

    for variable, value in platforms.cold_stop().items():
        os.environ.setdefault(variable, value)
    from tensorturn import trust
    from tensorturn.state.broker import check_broker
    from tensorturn.store.objects import open_store

    if not broker:
        raise TensorTurnError("the agent needs a pool: pass --join-file JOIN (from `tensorturn up`), "
                              "or --broker URL / TENSORTURN_BROKER_URL")
    from tensorturn.pool.routing import check_role

    check_role(role or config.current().role)  # TENSORTURN_ROLE may say anything
    from tensorturn.pool.owner import OwnerRules

    OwnerRules.from_settings(config.current())  # bad hours or caps: one clear line now, not a silent agent
    from tensorturn.pool.threads import pool_of

    pool_of(config.current())  # a bad TENSORTURN_AGENT_POOL: the same
    trust.pool_key()  # one clear error now rather than every task refused later
    check_broker(broker)
    open_store(store).check()
    from tensorturn.pool.agent import run_agent
    from tensorturn.pool.celery_app import configure

    configure(broker)
    run_agent(name, concurrency, loglevel)


@cli.command("local-agents", hidden=True)
@debug_option
def local_agents():
    """An embedded pool's warm parent (tensorturn.pool.warm): import what an agent needs once,
    read the agents to start from stdin (a JSON line of them: each one's name, environment and
    log; later lines, agents the pool starts again), fork each, and wait for them. Started by
    the pool, not by people."""
    import sys

    from tensorturn.cli import run_in
    from tensorturn.pool.warm import fork_agents, warm_up

    warm_up()  # before stdin is read: the pool starts Redis meanwhile, then writes the specs

    def agent_main(spec: dict[str, Any]) -> int:
        from tensorturn.pool.telemetry import new_incarnation

        new_incarnation()  # a start of its own, not the parent's (nor a killed sibling's)
        run_in(spec["env"], ["agent", "--name", spec["name"], "--concurrency", "1"])
        return 0

    sys.exit(fork_agents(sys.stdin.fileno(), agent_main, sys.stdout))


@cli.command()
@click.option("--port", type=click.IntRange(1, 65535), default=None,
              help="Redis port [default: 6379, or the one used last time].")
@click.option("--bind", default="0.0.0.0", show_default=True,
              help="Address Redis listens on (0.0.0.0: every interface, for your other machines).")
@click.option("--advertise", default=None, metavar="HOST",
              help="Host name or address the agents dial [default: this machine's address].")
@click.option("--dir", "directory", type=click.Path(file_okay=False), default=".tensorturn",
              show_default=True, help="Where Redis keeps its data, and the pool's secrets (mode 600).")
@pool_options(joins=False)  # it writes the join file: one named in the environment is its own
def up(broker, store, port, bind, advertise, directory):
    """Start the coordinator in the foreground: a Redis for the pool and the store.

    It writes the join file (DIR/join: broker, store, pool key, and the recipes --allow-recipe
    allows every agent to import) to copy to each of your machines, and prints how to use it.
    Stop it with Ctrl-C. Users with their own Redis and S3/MinIO do not need this: give agents
    --broker and --store, and the pool key (TENSORTURN_POOL_KEY).
    """
    from tensorturn.pool.coordinator import Coordinator

    if broker:
        raise TensorTurnError("`up` starts its own Redis; drop --broker (or unset TENSORTURN_BROKER_URL)")
    coordinator = Coordinator(directory, store, port, bind, advertise)
    home = coordinator.home
    # Nothing below is printed or written until our own Redis answers: a failed start leaves
    # no banner, and any join file an earlier `up` wrote here as it was. Ctrl-C from here on,
    # even while the banner prints, stops the Redis it started.
    stop_on_signals()
    try:
        coordinator.start()  # the join file is written before the instructions, which callers wait for
        click.echo(f"TensorTurn coordinator: Redis on {bind}:{coordinator.port} (AOF on, noeviction), "
                   f"store {config.mask_url(store)}, pool key {coordinator.key.key_id}", err=True)
        click.echo(f"The join file {home / 'join'} (mode 600) holds the Redis password and the pool "
                   f"key: copy it to each of your machines (e.g. scp) and run there:", err=True)
        click.echo("  tensorturn agent --join-file join --name NAME")
        click.echo("or run `tensorturn agent --join -` and paste the file's one line at its prompt.",
                   err=True)
        click.echo(f"Submit runs from here with: tensorturn run --join-file {home / 'join'} ...", err=True)
        click.echo("Ctrl-C stops the coordinator.", err=True)
        coordinator.wait()
    except KeyboardInterrupt:
        click.echo("stopping the coordinator", err=True)
    finally:
        coordinator.stop()
