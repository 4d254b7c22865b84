"""Secrets in what a process shows: URLs with passwords holding `@`, `:`, `/`, `?` or `#`, and
passwords in a URL's query, are masked whole in messages and process titles; a secret given on
the command line is off `/proc/<pid>/cmdline` before the CLI loads anything but the masking."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from conftest import clean_env

from tensorturn import config

# passwords as people pick them: every character urlsplit and a naive pattern trip on
NASTY = ["Sx1@Tail9", "Cc2:Dd3@Ee4", "Ff5/Gg6@Hh7", "Ii8?Jj9#Kk0", "@Ll1@Mm2@", "Nn3%40Oo4",
         "Pp5:@/?#Qq6"]


def pieces(secret: str) -> list[str]:
    """The parts of ``secret`` between its punctuation: none may show after masking."""
    return [p for p in re.split(r"[^A-Za-z0-9]+", secret) if p]


@pytest.mark.parametrize("password", NASTY)
@pytest.mark.parametrize("user", ["", "default"])
def test_a_password_with_any_character_is_masked_whole(password, user):
    url = f"redis://{user}:{password}@cache.example.com:6380/2"
    masked = config.mask_url(url)
    assert masked == f"redis://{user}:***@cache.example.com:6380/2"
    text = config.mask_text(f"cannot reach broker {url}: Error 111 (then rediss://{user}:{password}@h2:1/0)")
    assert text == (f"cannot reach broker redis://{user}:***@cache.example.com:6380/2: Error 111 "
                    f"(then rediss://{user}:***@h2:1/0)")
    assert not [p for p in pieces(password) if p in masked + text]


@pytest.mark.parametrize("url,expected", [
    ("redis://h:6379/0?password=Ab1cd", "redis://h:6379/0?password=***"),
    ("redis://h:6379/0?db=1&PassWord=Ab1cd&socket_timeout=5", "redis://h:6379/0?db=1&PassWord=***&socket_timeout=5"),
    ("redis://h/0?passwd=Ab1cd#x", "redis://h/0?passwd=***"),
    ("redis://h/0?pass=Ab1cd&token=Ef2gh&SECRET=Ij3kl&key=Mn4op", "redis://h/0?pass=***&token=***&SECRET=***&key=***"),
    ("https://s3.example.com/b/k?X-Amz-Credential=AK&X-Amz-Signature=Ab1cd&X-Amz-Security-Token=Ef2gh",
     "https://s3.example.com/b/k?X-Amz-Credential=AK&X-Amz-Signature=***&X-Amz-Security-Token=***"),
    ("redis://u:Ab1@cd@h/0?password=Ef2gh", "redis://u:***@h/0?password=***"),
    ("redis://h/0?passes=3&keyspace=x", "redis://h/0?passes=3&keyspace=x"),  # only the names above
])
def test_a_password_in_the_query_is_masked(url, expected):
    assert config.mask_url(url) == expected
    assert config.mask_text(f"broker {url} down") == f"broker {expected} down"


@pytest.mark.parametrize("text", [
    "store s3://bucket/prefix@2024 is fine", "file:///home/me/a@b/store", "no urls here: a:b@c",
    "mail me at someone@example.com", "http://minio:9000 and https://user@github.com/o/r",
])
def test_what_holds_no_password_is_left_alone(text):
    expected = text.replace("https://user@", "https://***@")  # a lone user part may be a token
    assert config.mask_text(text) == expected


def test_a_password_with_a_slash_in_a_message_that_urlsplit_misreads_is_masked():
    """urlsplit ends the host at the first `/`: ``redis://:ab/cd@h`` has no password for it, but
    ``ab/cd`` is one all the same (and would be quoted back in the broker's error)."""
    for url in ("redis://:Ab1/Cd2@h:1/0", "redis://u:Ab1/Cd2@Ef3@h:1/0", "redis://:Ab1@Cd2/Ef3@h:1/0"):
        masked = config.mask_url(url)
        assert masked.endswith("***@h:1/0") and not [p for p in ("Ab1", "Cd2", "Ef3") if p in masked], masked


SPY = """
import importlib.abc, sys

class FirstImport(importlib.abc.MetaPathFinder):
    '''Prints this process's command line as the CLI imports click, its first library.'''
    def find_spec(self, name, path=None, target=None):
        if name == "click":
            sys.meta_path.remove(self)
            print(open("/proc/self/cmdline", "rb").read().replace(b"\\0", b" ").decode(), flush=True)
            raise SystemExit(0)

sys.meta_path.insert(0, FirstImport())
from tensorturn.cli import main  # what the `tensorturn` console script runs
main()
"""


JOIN = "tt1.eyJicm9rZXIiOiAiU2VjcmV0SnNvbiJ9"


@pytest.mark.parametrize("args,secrets", [
    (["agent", "--join", JOIN], [JOIN[4:]]),
    (["workers", "--broker", "redis://default:Sx1@Tail9@127.0.0.1:1/0"], ["Sx1", "Tail9"]),
    (["workers", "--broker=redis://127.0.0.1:1/0?password=Qq1Secret"], ["Qq1Secret"]),
])
def test_a_secret_on_the_command_line_is_hidden_before_the_cli_loads_anything(tmp_path, args, secrets):
    """No timing: the command line is read at the moment the CLI first imports a library."""
    spy = tmp_path / "spy.py"
    spy.write_text(SPY)
    shown = subprocess.run([sys.executable, str(spy), *args], env=clean_env(), capture_output=True,
                           text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith(f"tensorturn {args[0]} ") and "***" in shown.stdout
    assert not [s for s in secrets if s in shown.stdout], shown.stdout


def test_an_embedded_pools_kept_logs_are_readable_by_their_owner_only(tmp_path, monkeypatch):
    """`.tensorturn/logs/<run>/`: every folder made there is 0700, every log 0600 (whatever the
    umask), so other users of the machine cannot even list which runs there were."""
    import os
    import stat

    from tensorturn.pool.embedded import keep_logs, logs_dir

    monkeypatch.chdir(tmp_path)
    (tmp_path / "agent-1.log").write_text("trained\n")
    old = os.umask(0o022)
    try:
        dest = tmp_path / keep_logs([tmp_path / "agent-1.log"], logs_dir("r1"), [])
    finally:
        os.umask(old)
    modes = {p.relative_to(tmp_path).as_posix(): stat.S_IMODE(p.stat().st_mode)
             for p in (tmp_path / ".tensorturn", tmp_path / ".tensorturn" / "logs", dest, dest / "agent-1.log")}
    assert modes == {".tensorturn": 0o700, ".tensorturn/logs": 0o700, ".tensorturn/logs/r1": 0o700,
                     ".tensorturn/logs/r1/agent-1.log": 0o600}


def test_public_masks_strings_and_the_values_of_fields_named_like_secrets():
    """What leaves the machine (tracker parameters, an exported folder): a user's recipe options
    with their secrets masked, by the field's name or inside the text; names that only look
    alike (``tokens_per_step``, ``design``) kept."""
    from tensorturn import config

    options = {"data": "s3://AKIA:wJalr@minio:9000/b/book.txt", "api_token": "hf_abc",
               "nested": [{"password": "p", "design": "wide"}], "tokens_per_step": 512,
               "aws_secret_access_key": "k", "hf-token": "x", "sig": "s", "note": "join ttk1.c2VjcmV0c2VjcmV0"}
    assert config.public(options) == {
        "data": "s3://AKIA:***@minio:9000/b/book.txt", "api_token": "***",
        "nested": [{"password": "***", "design": "wide"}], "tokens_per_step": 512,
        "aws_secret_access_key": "***", "hf-token": "***", "sig": "***", "note": "join ttk1.***"}


def test_status_masks_secret_recipe_options_in_every_output(world):
    """`status`'s "ran with:" line, `--print-config` and `--json` showed `password=…`, `api_key=…`
    and a URL's password in clear, while the dashboard, report.html and `runs --json` masked them."""
    from conftest import tt_here

    from tensorturn import config, trust

    config.use(trust.with_allowed(config.current(), ["contract_recipes:*"]))
    secrets = {"password": "hunter2pw", "api_key": "sk-live-0123456789", "endpoint": "https://me:urlpass9@h.example/x"}
    spec = world.submit(mode="fused", recipe="contract_recipes:Configured", recipe_options=dict(secrets),
                        rounds=1, shards=1, sync_every=2,
                        run_config={"mode": "fused", "recipe": "contract_recipes:Configured",
                                    "recipe_options": dict(secrets), "rounds": 1})
    where = ("--broker", world.broker, "--store", spec.store_url)
    outputs = [tt_here("status", spec.run_id, *where, *flags) for flags in ((), ("--json",), ("--print-config",))]
    for proc in outputs:
        assert proc.returncode == 0, proc.stderr
        for secret in ("hunter2pw", "sk-live-0123456789", "urlpass9"):
            assert secret not in proc.stdout + proc.stderr
    assert "'password': '***'" in outputs[0].stdout and "https://me:***@h.example/x" in outputs[0].stdout
