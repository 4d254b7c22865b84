"""``agent`` and ``up``: joining a machine to the pool, and running the coordinator."""

from __future__ import annotations

import click

from .. import config
from ..errors import TensorTurnError
from . import cli, pool_options, stop_on_signals


@cli.command()
@click.option("--join", "join", metavar="JOIN", envvar="TENSORTURN_JOIN",
              help="The join string `tensorturn up` printed (carries the broker and store).")
@click.option("--name", default=None, help="Worker name (shown as NAME@host) [default: agent].")
@click.option("--concurrency", type=click.IntRange(min=1), default=1, show_default=True,
              help="Tasks at once on this machine. One is right for a GPU and for CPUs "
                   "(each CPU task uses --threads-per-task threads).")
@click.option("--memory-gb", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Offer at most this much device memory (VRAM, or RAM on CPU) to the pool.")
@click.option("--loglevel", default=None, help="Celery log level [default: INFO].")
@pool_options()
def agent(broker, store, join, name, concurrency, memory_gb, loglevel):
    """Run this machine's agent: a Celery worker that trains what the pool queues.

    It only opens outbound connections, to the broker and the store, reconnects forever when the
    network drops, and on SIGTERM puts its running task back in the queue within a few seconds.
    """
    import os

    # SIGTERM (systemd, Ctrl-C of a supervisor) becomes Celery's cold shutdown with a short soft
    # grace: running tasks get a few seconds, then their messages go straight back to the queue.
    # billiard reads this when first imported, so it is set before anything imports Celery.
    os.environ.setdefault("REMAP_SIGTERM", "SIGQUIT")
    from ..broker import check_broker
    from ..store import open_store

    store_given = bool(os.environ.get("TENSORTURN_STORE_URL"))
    if join:
        from ..coordinator import apply_join, parse_join

        broker, joined_store = apply_join(parse_join(join))
        if joined_store:
            store, store_given = joined_store, True
    if not broker:
        raise TensorTurnError("the agent needs a pool: pass --join JOIN (from `tensorturn up`), "
                              "or --broker URL / TENSORTURN_BROKER_URL")
    check_broker(broker)
    if store_given:
        open_store(store).check()
    # what this command was told overrides the environment, for this process and its pool
    config.use(config.current().with_(broker_url=broker, store_url=store,
                                      device_memory_gb=memory_gb or config.current().device_memory_gb))
    from ..agent import run_agent
    from ..celery_app import configure

    configure(broker)
    run_agent(name, concurrency, loglevel)


@cli.command()
@click.option("--port", type=click.IntRange(1, 65535), default=None,
              help="Redis port [default: 6379, or the one used last time].")
@click.option("--bind", default="0.0.0.0", show_default=True,
              help="Address Redis listens on (0.0.0.0: every interface, for your other machines).")
@click.option("--advertise", default=None, metavar="HOST",
              help="Host name or address the agents dial [default: this machine's address].")
@click.option("--dir", "directory", type=click.Path(file_okay=False), default=".tensorturn",
              show_default=True, help="Where Redis keeps its data and the generated password.")
@pool_options()
def up(broker, store, port, bind, advertise, directory):
    """Start the coordinator in the foreground: a Redis for the pool and the store.

    It prints the one line to paste on each of your machines. Stop it with Ctrl-C. Users with
    their own Redis and S3/MinIO do not need this: give agents --broker and --store instead.
    """
    from pathlib import Path

    from ..coordinator import CoordinatorConfig, advertised_host, make_join
    from ..local import RedisServer
    from ..store import open_store

    if broker:
        raise TensorTurnError("`up` starts its own Redis; drop --broker (or unset TENSORTURN_BROKER_URL)")
    home = Path(directory).resolve()
    cfg = CoordinatorConfig.load_or_create(home, port or 0)
    open_store(store).check()
    server = RedisServer(home / "redis", port=cfg.port, appendonly=True, password=cfg.password,
                         bind=bind)
    try:
        server.start()
    except TensorTurnError as exc:
        raise TensorTurnError(f"{exc}; is port {cfg.port} in use? try --port") from None
    host = advertise or (advertised_host() if bind == "0.0.0.0" else bind)
    broker_url = f"redis://:{cfg.password}@{host}:{cfg.port}/0"
    join = make_join(broker_url, store)
    url_file = home / "broker-url"  # written before the join line, which callers wait for
    url_file.write_text(broker_url + "\n")
    url_file.chmod(0o600)
    click.echo(f"TensorTurn coordinator: Redis on {bind}:{cfg.port} (AOF on, noeviction), "
               f"store {config.mask_url(store)}", err=True)
    click.echo("On each of your machines, run (this line is a secret: it holds the Redis "
               "password):", err=True)
    click.echo(f"  tensorturn agent --join {join}")
    click.echo(f"Submit runs with: TENSORTURN_BROKER_URL=$(cat {home / 'broker-url'}) tensorturn run ...",
               err=True)
    click.echo("Ctrl-C stops the coordinator.", err=True)
    stop_on_signals()
    try:
        assert server.proc is not None  # started above
        server.proc.wait()
        raise TensorTurnError(f"redis-server exited (log: {home / 'redis' / 'redis.log'})")
    except KeyboardInterrupt:
        click.echo("stopping the coordinator", err=True)
    finally:
        server.stop()
