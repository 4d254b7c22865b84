"""``serve`` and ``token``: the result as an authenticated HTTP API, and its tokens."""

from __future__ import annotations

import time

import click

from tensorturn.cli import cli, emit_json, pool_options


@cli.command()
@click.argument("run_id")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0 for every interface).")
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option("--name", "alias", default=None, help="An alias for the model besides the run id.")
@click.option("--max-body-mb", type=click.FloatRange(min=0, min_open=True), default=8.0,
              show_default=True, help="Largest request body accepted (larger → 413).")
@click.option("--max-rows", type=click.IntRange(min=1), default=4096, show_default=True,
              help="Most rows in one request (more → 413).")
@click.option("--max-batch-rows", type=click.IntRange(min=1), default=1024, show_default=True,
              help="Most rows in one model call: concurrent requests are batched up to this.")
@click.option("--batch-window-ms", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Wait this long for more requests before running a batch (0: run what is "
                   "queued at once).")
@click.option("--model-threads", type=click.IntRange(min=1), default=1, show_default=True,
              help="Torch threads for the model (one model thread runs every batch).")
@click.option("--request-timeout", type=click.FloatRange(min=0, min_open=True), default=10.0,
              show_default=True,
              help="Seconds a connection has to send a whole request (headers and body); then "
                   "it is closed.")
@click.option("--limit-concurrency", type=click.IntRange(min=1), default=1000, show_default=True,
              help="Connections and requests in flight before new requests get 503.")
@click.option("--auth-failures-per-minute", type=click.IntRange(min=1), default=20,
              show_default=True,
              help="Failed authentications one address may make per minute before it gets 429 "
                   "(valid tokens are never refused).")
@click.option("--trusted-proxy", "trusted_proxies", multiple=True, metavar="ADDRESS",
              help="A reverse proxy in front of the API (repeat for more): only requests from it "
                   "are taken to come from the address its X-Forwarded-For names (what the failed "
                   "authentication limit counts). Without one, that header is ignored.")
@click.option("--access-log/--no-access-log", default=False, show_default=True,
              help="Log every request.")
@pool_options()
def serve(broker, store, run_id, host, port, alias, max_body_mb, max_rows, max_batch_rows,
          batch_window_ms, model_threads, request_timeout, limit_concurrency, auth_failures_per_minute,
          trusted_proxies, access_log):
    """Serve a run's model (or voting ensemble) as an authenticated HTTP API.

    Open Inference Protocol (KServe V2) routes under /v2; OpenAPI page at /docs. Every
    /v2/models route needs `Authorization: Bearer <token>` from `tensorturn token create`.
    The server needs only the store. Concurrent requests are batched into one model call.
    """
    from tensorturn.serve.app import ServeOptions
    from tensorturn.serve.server import run_server
    from tensorturn.store.objects import open_store

    options = ServeOptions(max_rows=max_rows, max_batch_rows=max_batch_rows,
                           batch_window_ms=batch_window_ms, model_threads=model_threads,
                           request_timeout_s=request_timeout, limit_concurrency=limit_concurrency,
                           auth_failure_limit=auth_failures_per_minute, access_log=access_log,
                           trusted_proxies=tuple(trusted_proxies))
    run_server(open_store(store), run_id, host, port, alias, int(max_body_mb * 1024 * 1024),
               options)


@cli.group()
def token():
    """API tokens: create (shown once), list, revoke. Only their hashes are stored."""


@token.command("create")
@click.option("--name", default=None, help="A label to recognise the token by.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (with the token).")
@pool_options()
def token_create(broker, store, name, as_json):
    """Create a token and print it once; it cannot be shown again."""
    from tensorturn.serve import tokens
    from tensorturn.store.objects import open_store

    secret, record = tokens.create(open_store(store), name)
    if as_json:
        emit_json({**tokens.public(record), "token": secret})
        return
    click.echo(secret)
    click.echo(f"token {record['id']} ({record['name']}) created; this is the only time it is "
               f"shown. Send it as 'Authorization: Bearer <token>'.", err=True)


@token.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list.")
@pool_options()
def token_list(broker, store, as_json):
    """List tokens (ids, names, dates; never the tokens themselves)."""
    from tensorturn.serve import tokens
    from tensorturn.store.objects import open_store

    items = [tokens.public(r) for r in tokens.records(open_store(store))]
    if as_json:
        emit_json(items)
        return
    if not items:
        click.echo("no tokens")
    for t in items:
        state = "revoked" if t["revoked_at"] else "active"
        created = time.strftime("%Y-%m-%d %H:%M", time.localtime(t["created_at"]))
        click.echo(f"{t['id']}  {t['name']:20s} {state:8s} created {created}")


@token.command("revoke")
@click.argument("id_or_name")
@pool_options()
def token_revoke(broker, store, id_or_name):
    """Revoke a token by id or name; servers refuse it within a few seconds."""
    from tensorturn.serve import tokens
    from tensorturn.store.objects import open_store

    record = tokens.revoke(open_store(store), id_or_name)
    click.echo(f"token {record['id']} ({record['name']}) revoked")
