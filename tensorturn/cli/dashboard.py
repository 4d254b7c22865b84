"""``dashboard``: a live web view of the pool's machines, its runs and the served models."""

from __future__ import annotations

import click

from tensorturn.cli import cli, pool_options


@cli.command()
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on. Beyond loopback (0.0.0.0, a LAN address) the page's data "
                   "needs an API token, as the inference API does (`tensorturn token create`).")
@click.option("--port", type=click.IntRange(1, 65535), default=8265, show_default=True)
@click.option("--refresh", "refresh_s", type=click.FloatRange(0.2, 3600), default=2.0, show_default=True,
              help="Seconds between the page's updates (the server reads the pool at most this often, "
                   "however many pages are open).")
@click.option("--runs", "runs_shown", type=click.IntRange(1, 1000), default=30, show_default=True,
              help="How many of the newest runs to list.")
@click.option("--allowed-host", "allowed_hosts", multiple=True, metavar="NAME",
              help="Beyond loopback, answer only requests for this host name (repeat for more; "
                   "default: any). On loopback only localhost, 127.0.0.1 and [::1] are answered, "
                   "whatever this says: a page of another site cannot reach the dashboard by DNS "
                   "rebinding.")
@pool_options()
def dashboard(broker, store, host, port, refresh_s, runs_shown, allowed_hosts):
    """Serve a live web page of the pool: machines (state and why, device, memory, utilisation,
    current task, samples/s), runs (progress, loss and accuracy by round, a per-machine timeline
    of attempts, failures and incidents, bytes moved, the kept round) and the served models.

    \b
    Open http://127.0.0.1:8265 (the default). It reads the broker and the store as `workers`
    and `status` do; without a broker it shows the store's runs only. No secret is ever on the
    page: URLs are masked. Stop it with Ctrl-C.
    """
    from tensorturn.dashboard.app import DashboardOptions, run_dashboard

    run_dashboard(broker, store, host, port, DashboardOptions(refresh_s=refresh_s, runs_shown=runs_shown,
                                                              allowed_hosts=tuple(allowed_hosts)))
