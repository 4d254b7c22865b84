"""The coordinator's deploy files, read with real parsers and, where possible, run for real.

deploy/docker-compose.yml (PyYAML), deploy/redis.conf (a real redis-server), deploy/env.example,
deploy/Dockerfile, the Procfile (expanded by a real ``sh``), the systemd unit (configparser) and
the launcher script (a real ``sh``, and a real agent on a real redis-server).
"""

from __future__ import annotations

import configparser
import os
import re
import shlex
import shutil
import subprocess
import time
from pathlib import Path

import click
import pytest
import redis
import yaml
from conftest import ROOT

from tensorturn.pool.embedded import free_port, redis_server_binary, stop_process_group

DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
REDIS_CONF = DEPLOY / "redis.conf"
ENV_EXAMPLE = DEPLOY / "env.example"
DOCKERFILE = DEPLOY / "Dockerfile"
PROCFILE = ROOT / "Procfile"
UNIT = ROOT / "workers" / "tensorturn-agent.service"
LAUNCHER = ROOT / "workers" / "tensorturn-agent.sh"

# ${VAR}, ${VAR:-default}, ${VAR:?error}, ... and bare $VAR, as compose and sh read them.
VAR_REF = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)([:?+-][^}]*)?\}|([A-Za-z_][A-Za-z0-9_]*))")
SECRET_NAME = re.compile(r"PASSWORD|SECRET|AUTH|TOKEN")
PLACEHOLDER = "change-me"


# ---- parsers -------------------------------------------------------------------------------------

def compose() -> dict:
    doc = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(doc, dict) and isinstance(doc.get("services"), dict), "no services mapping"
    return doc


def service(name: str) -> dict:
    return compose()["services"][name]


def argv(value) -> list[str]:
    """A compose ``command``/``test``: a list as is, a string split as compose splits it."""
    return [str(v) for v in value] if isinstance(value, list) else shlex.split(value)


def env_map(value) -> dict[str, str]:
    """A compose ``environment``: mapping or list of KEY=VALUE."""
    if isinstance(value, dict):
        return {k: "" if v is None else str(v) for k, v in value.items()}
    return dict(item.split("=", 1) for item in value or [])


def var_refs(text: str) -> list[tuple[str, str | None]]:
    """(name, modifier) of every interpolated variable; ``$$`` is a literal dollar, skipped."""
    out = []
    for m in VAR_REF.finditer(text.replace("$$", "")):
        out.append((m.group(1) or m.group(3), m.group(2)))
    return out


def env_example() -> dict[str, str]:
    values: dict[str, str] = {}
    for n, line in enumerate(ENV_EXAMPLE.read_text().splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep and re.fullmatch(r"[A-Z_][A-Z0-9_]*", key), f"env.example:{n}: not KEY=VALUE: {line!r}"
        assert key not in values, f"env.example: {key} defined twice"
        assert value == value.strip() and not value.startswith(("'", '"')), \
            f"env.example: {key}: keep values unquoted and unpadded (compose and honcho differ)"
        values[key] = value
    return values


def redis_conf() -> dict[str, str]:
    """Directive -> argument(s) as redis-server reads the file (the last occurrence wins)."""
    conf: dict[str, str] = {}
    for line in REDIS_CONF.read_text().splitlines():
        words = shlex.split(line, comments=True)
        if words:
            conf[words[0].lower()] = " ".join(words[1:])
    return conf


def procfile() -> dict[str, str]:
    lines: dict[str, str] = {}
    for line in PROCFILE.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        m = re.fullmatch(r"([A-Za-z0-9_-]+):\s*(\S.*)", line)
        assert m, f"Procfile: not 'name: command': {line!r}"
        assert m.group(1) not in lines, f"Procfile: {m.group(1)} twice"
        lines[m.group(1)] = m.group(2)
    return lines


def shell_words(cmdline: str, env: dict[str, str]) -> list[str]:
    """The argv a real ``sh`` builds from ``cmdline`` in ``env``, without running it."""
    proc = subprocess.run(["/bin/sh", "-c", f'set -- {cmdline}; printf "%s\\0" "$@"'],
                          env={"PATH": os.defpath, **env}, capture_output=True, text=True, timeout=10)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split("\0")[:-1]


def check_tensorturn_args(args: list[str]) -> None:
    """Parse ``tensorturn ARGS`` with the real CLI (no command runs): the command and every option
    a deploy file uses must exist."""
    from tensorturn.cli import cli

    assert args, "no tensorturn command"
    command = cli.get_command(click.Context(cli), args[0])
    if command is None and args[0] == "serve":
        pytest.skip("`tensorturn serve` is not in the CLI yet")
    assert command is not None, f"`tensorturn {args[0]}` is not a command"
    command.make_context(args[0], list(args[1:]))  # raises on an unknown option or bad value


def procfile_run(cmdline: str, env: dict[str, str], program: str) -> tuple[list[str], str]:
    """Run a Procfile line in a real ``sh`` with ``program`` replaced by a stand-in that records
    the arguments it was given and what it read on stdin."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        stub = Path(tmp) / program
        stub.write_text(f'#!/bin/sh\nprintf "%s\\0" "$@" > {tmp}/argv\ncat > {tmp}/stdin\n')
        stub.chmod(0o755)
        proc = subprocess.run(["/bin/sh", "-c", cmdline], env={"PATH": f"{tmp}:{os.defpath}", **env},
                              cwd=ROOT, capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, proc.stderr
        return (Path(tmp, "argv").read_text().split("\0")[:-1], Path(tmp, "stdin").read_text())


def option_value(args: list[str], option: str) -> str:
    """``--opt VALUE`` or ``--opt=VALUE``."""
    for i, a in enumerate(args):
        if a == option:
            return args[i + 1]
        if a.startswith(option + "="):
            return a[len(option) + 1:]
    raise AssertionError(f"{option} not in {args}")


# ---- docker-compose.yml --------------------------------------------------------------------------

def test_compose_has_the_coordinator_services():
    doc = compose()
    assert {"redis", "minio", "flower", "api"} <= set(doc["services"])
    for name, svc in doc["services"].items():
        assert "image" in svc or "build" in svc, f"{name}: neither image nor build"
    for name in doc.get("volumes") or {}:
        assert re.fullmatch(r"[a-zA-Z0-9][a-zA-Z0-9_.-]*", name)


def test_compose_redis_password_aof_noeviction_and_healthcheck():
    svc = service("redis")
    assert str(svc["image"]).split(":")[0] == "redis" and str(svc["image"]).startswith("redis:7")
    cmd = argv(svc["command"])
    assert cmd[:2] == ["sh", "-c"]
    script = cmd[2]
    # the password comes from the env through stdin: never from the file, never on a command
    # line; an empty one is refused
    assert script.startswith("printf 'requirepass \"%s\"\\n' \"$$REDIS_PASSWORD\" | exec redis-server "), script
    assert script.endswith(" -") and "--requirepass" not in script
    assert var_refs(script) == []  # $$: expanded by the container's shell, not by compose
    password = env_map(svc["environment"])["REDIS_PASSWORD"]
    name, modifier = var_refs(password)[0]
    assert name == "REDIS_PASSWORD" and modifier and modifier.startswith(":?"), password
    # the mounted redis.conf is this repository's, read-only, and is the file redis-server loads
    mounts = [str(v).split(":") for v in svc["volumes"]]
    conf_mounts = [m for m in mounts if m[0].endswith("redis.conf")]
    assert len(conf_mounts) == 1, mounts
    source, target, *mode = conf_mounts[0]
    assert (COMPOSE.parent / source).resolve() == REDIS_CONF
    assert mode == ["ro"]
    assert shlex.split(script.split("|")[1])[2] == target, "redis-server must be given the mounted config file"
    assert any(m[1] == "/data" for m in mounts), "no volume for /data (the AOF lives there)"
    # AOF and noeviction: in that file (checked below), not overridden on the command line
    for directive in ("--appendonly", "--maxmemory-policy"):
        assert directive not in cmd
    # healthcheck: redis-cli PING with the password
    test = argv(svc["healthcheck"]["test"])
    assert test[0] in ("CMD", "CMD-SHELL")
    script = " ".join(test[1:])
    assert "redis-cli" in script and "ping" in script.lower()
    assert "REDISCLI_AUTH=" in script  # the password in redis-cli's environment
    assert not re.search(r"(-a|--pass|--user|-u)\s", script), "never on its command line"
    assert "REDIS_PASSWORD" in script
    if "$$REDIS_PASSWORD" in script:  # expanded by the container's shell: must be in its env
        assert "REDIS_PASSWORD" in env_map(svc.get("environment"))


def test_compose_healthcheck_script_works_against_a_real_redis(tmp_path):
    """Run the healthcheck's shell line, aimed at a real password-protected redis-server: it passes
    with the right password and fails with a wrong one (an auth error is not a PONG)."""
    cli_bin = shutil.which("redis-cli") or str(Path(redis_server_binary()).with_name("redis-cli"))
    if not Path(cli_bin).exists():
        pytest.skip("no redis-cli here")
    test = argv(service("redis")["healthcheck"]["test"])
    assert test[0] == "CMD-SHELL"
    port = free_port()
    script = test[1].replace("$$", "$").replace("redis-cli", f"{shlex.quote(cli_bin)} -p {port}", 1)
    with running_redis(tmp_path, port, "pw-right") as _:
        ok = subprocess.run(["/bin/sh", "-c", script], env={"PATH": os.defpath, "REDIS_PASSWORD": "pw-right"},
                            capture_output=True, timeout=20)
        bad = subprocess.run(["/bin/sh", "-c", script], env={"PATH": os.defpath, "REDIS_PASSWORD": "pw-wrong"},
                             capture_output=True, timeout=20)
    assert ok.returncode == 0, ok.stderr
    assert bad.returncode != 0


def test_compose_minio():
    svc = service("minio")
    assert str(svc["image"]).split(":")[0] == "minio/minio"
    cmd = argv(svc["command"])
    assert cmd[:2] == ["server", "/data"]
    assert option_value(cmd, "--console-address") == ":9001"
    env = env_map(svc["environment"])
    for key in ("MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD"):
        assert [n for n, _ in var_refs(env[key])] == [key], f"{key} must come from .env"
    assert any(str(v).split(":")[1] == "/data" for v in svc["volumes"])


def test_compose_builds_the_project_image():
    for name in ("flower", "api"):
        build = service(name)["build"]
        context = (COMPOSE.parent / build["context"]).resolve()
        assert context == ROOT, f"{name}: build context must be the repository root"
        assert (context / build["dockerfile"]).resolve() == DOCKERFILE
        assert "image" not in service(name) or service(name).get("pull_policy") == "build", \
            f"{name}: a named image could be pulled from a registry instead of built"
    lines = [ln.strip() for ln in DOCKERFILE.read_text().splitlines()
             if ln.strip() and not ln.lstrip().startswith("#")]
    assert lines[0] == "FROM python:3.11-slim"
    for line in lines:
        if line.upper().startswith("COPY "):
            *sources, _dest = shlex.split(line)[1:]
            for src in sources:
                assert (ROOT / src).exists(), f"Dockerfile copies {src}, which the context lacks"
    assert any(re.match(r"RUN pip install .*--no-cache-dir.* \.(\s|$)", ln) for ln in lines)
    assert any(ln.startswith("USER ") and ln.split()[1] != "root" for ln in lines)


def test_compose_flower_has_basic_auth_and_the_pool_broker():
    svc = service("flower")
    cmd = argv(svc["command"])
    assert cmd[:4] == ["celery", "-A", "tensorturn.pool.celery_app", "flower"]
    assert not any(a.startswith("--basic-auth") for a in cmd)  # off the command line
    auth = env_map(svc["environment"])["FLOWER_BASIC_AUTH"]
    assert [n for n, _ in var_refs(auth)] == ["FLOWER_BASIC_AUTH"]
    broker = env_map(svc["environment"])["TENSORTURN_BROKER_URL"]
    assert re.fullmatch(r"redis://:\$\{REDIS_PASSWORD[^}]*\}@redis:6379/\d+", broker), broker
    assert svc["depends_on"]["redis"]["condition"] == "service_healthy"


def test_compose_api_runs_tensorturn_serve():
    svc = service("api")
    cmd = argv(svc["command"])
    assert cmd[:2] == ["tensorturn", "serve"]
    assert [n for n, _ in var_refs(cmd[2])] == ["TENSORTURN_SERVE_RUN"]
    assert option_value(cmd, "--host") == "0.0.0.0"
    port = option_value(cmd, "--port")
    assert any(str(p).split(":")[-1] == port for p in svc["ports"])
    env = env_map(svc["environment"])
    assert {"TENSORTURN_STORE_URL", "AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY"} <= set(env)
    assert env["AWS_ENDPOINT_URL"] == "http://minio:9000"


def test_compose_api_command_parses_with_the_real_cli():
    cmd = argv(service("api")["command"])
    sample = {n: env_example()[n] for n, _ in var_refs(" ".join(cmd))}
    check_tensorturn_args([re.sub(VAR_REF, lambda m: sample[m.group(1) or m.group(3)], a) for a in cmd[1:]])


def test_compose_admin_interfaces_listen_on_loopback_only():
    """Flower (which can shut agents down) and the MinIO console are not published to the network."""
    published = {name: [str(p) for p in svc.get("ports", [])] for name, svc in compose()["services"].items()}
    for name, target in (("flower", "5555"), ("minio", "9001")):
        entries = [p for p in published[name] if p.split(":")[-1] == target]
        assert entries and all(p.startswith("127.0.0.1:") for p in entries), published[name]


def strings(node):
    """Every string in a parsed YAML document (keys and values: compose interpolates both)."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from strings(k)
            yield from strings(v)
    elif isinstance(node, list):
        for v in node:
            yield from strings(v)
    elif isinstance(node, str):
        yield node


def test_every_compose_variable_is_in_env_example():
    used = {name for text in strings(compose()) for name, _ in var_refs(text)}
    assert {"REDIS_PASSWORD", "MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD", "FLOWER_BASIC_AUTH",
            "TENSORTURN_SERVE_RUN"} <= used
    missing = used - set(env_example())
    assert not missing, f"compose uses variables env.example does not define: {sorted(missing)}"


def test_compose_config_with_docker_compose_if_installed(tmp_path):
    """Where a compose CLI exists, it must accept the file (with env.example as the .env)."""
    if shutil.which("docker-compose"):
        base = ["docker-compose"]
    elif shutil.which("docker") and subprocess.run(["docker", "compose", "version"],
                                                    capture_output=True).returncode == 0:
        base = ["docker", "compose"]
    else:
        pytest.skip("no docker compose CLI here")
    (tmp_path / "deploy").mkdir()
    shutil.copy(COMPOSE, tmp_path / "deploy" / COMPOSE.name)
    shutil.copy(REDIS_CONF, tmp_path / "deploy" / REDIS_CONF.name)
    shutil.copy(ENV_EXAMPLE, tmp_path / "deploy" / ".env")
    env = {k: v for k, v in os.environ.items() if k not in env_example()}
    ok = subprocess.run(base + ["-f", str(tmp_path / "deploy" / COMPOSE.name), "config"],
                        cwd=tmp_path / "deploy", env=env, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert "change-me-long-random" in ok.stdout  # interpolated from .env
    # a required secret left out stops compose before anything could start
    (tmp_path / "deploy" / ".env").write_text(
        "".join(ln + "\n" for ln in ENV_EXAMPLE.read_text().splitlines()
                if not ln.startswith("REDIS_PASSWORD=")))
    bad = subprocess.run(base + ["-f", str(tmp_path / "deploy" / COMPOSE.name), "config"],
                         cwd=tmp_path / "deploy", env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "REDIS_PASSWORD" in bad.stderr


# ---- redis.conf ----------------------------------------------------------------------------------

def test_redis_conf_settings():
    conf = redis_conf()
    assert conf["maxmemory-policy"] == "noeviction"
    assert conf["appendonly"] == "yes"
    assert "requirepass" not in conf, "the password comes on stdin, not in the file"


class running_redis:
    """``redis-server deploy/redis.conf`` on a loopback port (the command line overrides bind),
    the password on stdin as the Procfile and docker-compose give it."""

    def __init__(self, tmp_path: Path, port: int, password: str):
        self.tmp, self.port, self.password = tmp_path, port, password

    def __enter__(self) -> redis.Redis:
        data = self.tmp / f"redis-{self.port}"
        data.mkdir()
        self.log = open(self.tmp / f"redis-{self.port}.log", "wb")
        self.proc = subprocess.Popen(
            [redis_server_binary(), str(REDIS_CONF), "--port", str(self.port), "--bind", "127.0.0.1",
             "--dir", str(data), "--daemonize", "no", "-"], stdin=subprocess.PIPE,
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.proc.stdin.write(f'requirepass "{self.password}"\n'.encode())
        self.proc.stdin.close()
        client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password,
                             socket_connect_timeout=1, decode_responses=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.close()
                pytest.fail("redis-server refused deploy/redis.conf:\n"
                            + (self.tmp / f"redis-{self.port}.log").read_text()[-2000:])
            try:
                client.ping()
                return client
            except redis.ConnectionError:
                time.sleep(0.05)
        self.__exit__()
        pytest.fail("redis-server with deploy/redis.conf did not answer")

    def __exit__(self, *exc) -> None:
        stop_process_group(self.proc, grace=10)
        self.log.close()


def test_redis_conf_is_accepted_by_a_real_redis_server(tmp_path):
    port = free_port()
    with running_redis(tmp_path, port, "x") as client:
        assert client.ping() is True
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        assert client.config_get("bind")["bind"] == "127.0.0.1"
        # the password from stdin works with this file: no password, or a wrong one, gets nothing
        # (asked once: redis-py retries a refused login with a backoff of seconds by default)
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=1, retry=None).ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=port, password="y", socket_connect_timeout=1,
                        retry=None).ping()


# ---- env.example ---------------------------------------------------------------------------------

def test_env_example_holds_placeholders_only():
    values = env_example()
    secrets_seen = []
    for key, value in values.items():
        if SECRET_NAME.search(key):
            secrets_seen.append(key)
            assert PLACEHOLDER in value, f"{key} looks like a real secret: use a {PLACEHOLDER} placeholder"
        for m in re.finditer(r"\w+://([^:/@\s]*):([^@\s]*)@", value):
            assert PLACEHOLDER in m.group(2), f"{key}: the password in the URL must be a placeholder"
        assert not re.search(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b", value), f"{key}: an AWS key id"
    assert {"REDIS_PASSWORD", "MINIO_ROOT_PASSWORD", "AWS_SECRET_ACCESS_KEY",
            "FLOWER_BASIC_AUTH"} <= set(secrets_seen)


def test_env_example_values_fit_together():
    values = env_example()
    # agents' broker URL carries the Redis password
    assert re.fullmatch(r"redis://default:([^@]+)@[^:/]+:6379/\d+", values["TENSORTURN_BROKER_URL"]).group(1) \
        == values["REDIS_PASSWORD"]
    user, _, password = values["FLOWER_BASIC_AUTH"].partition(":")
    assert user and password, "FLOWER_BASIC_AUTH is user:password"
    # MinIO refuses to start with a root user under 3 or a password under 8 characters
    assert len(values["MINIO_ROOT_USER"]) >= 3 and len(values["MINIO_ROOT_PASSWORD"]) >= 8
    assert values["TENSORTURN_STORE_URL"].startswith("s3://")


# ---- Procfile ------------------------------------------------------------------------------------

def test_procfile_lines():
    lines = procfile()
    assert {"redis", "flower", "worker", "api"} <= set(lines)
    env = env_example()
    for name, cmdline in lines.items():
        syntax = subprocess.run(["/bin/sh", "-n", "-c", cmdline], capture_output=True, text=True)
        assert syntax.returncode == 0, f"Procfile {name}: {syntax.stderr}"
        for var, modifier in var_refs(cmdline):
            assert modifier or var in env, f"Procfile {name}: ${var} has no default and no env.example entry"


def test_procfile_commands_as_the_shell_expands_them():
    env = env_example()
    lines = procfile()

    redis_argv, redis_stdin = procfile_run(lines["redis"], env, "redis-server")
    assert redis_argv == ["deploy/redis.conf", "-"]  # the password is not among them
    assert (ROOT / redis_argv[0]).resolve() == REDIS_CONF
    assert redis_stdin == f'requirepass "{env["REDIS_PASSWORD"]}"\n'

    flower = shell_words(lines["flower"], env)
    assert flower[:4] == ["celery", "-A", "tensorturn.pool.celery_app", "flower"]
    assert not any(a.startswith("--basic-auth") for a in flower)  # FLOWER_BASIC_AUTH, from .env

    worker = shell_words(lines["worker"], env)
    assert worker[:2] == ["tensorturn", "agent"] and option_value(worker, "--name") == "agent"
    assert option_value(shell_words(lines["worker"], {**env, "AGENT_NAME": "pc 1"}), "--name") == "pc 1"
    check_tensorturn_args(worker[1:])

    api = shell_words(lines["api"], env)
    assert api[:3] == ["tensorturn", "serve", env["TENSORTURN_SERVE_RUN"]]
    assert option_value(api, "--host") == "0.0.0.0" and option_value(api, "--port") == "8000"
    assert option_value(shell_words(lines["api"], {**env, "PORT": "5100"}), "--port") == "5100"


def test_procfile_api_parses_with_the_real_cli():
    check_tensorturn_args(shell_words(procfile()["api"], env_example())[1:])


# ---- workers/: systemd unit and launcher ---------------------------------------------------------

def test_systemd_unit():
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # systemd keys are case-sensitive
    unit.read_string(UNIT.read_text())
    assert {"Unit", "Service", "Install"} <= set(unit.sections())
    service_ = unit["Service"]
    exec_start = shlex.split(service_["ExecStart"])
    assert exec_start[0].startswith("/"), "systemd needs an absolute ExecStart path"
    words = exec_start[1:] if exec_start[0] == "/usr/bin/env" else exec_start
    assert Path(words[0]).name == "tensorturn" and words[1] == "agent"
    check_tensorturn_args([w.replace("%H", "host") for w in words[1:]])
    assert service_["Restart"] == "always"
    assert service_["KillSignal"] == "SIGTERM", "Celery's warm shutdown"
    assert "EnvironmentFile" in service_
    assert unit["Install"]["WantedBy"] == "multi-user.target"


def test_launcher_syntax():
    proc = subprocess.run(["/bin/sh", "-n", str(LAUNCHER)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert os.access(LAUNCHER, os.X_OK), "the launcher should be executable"


@pytest.mark.parametrize("env", [{}, {"TENSORTURN_BROKER_URL": ""}], ids=["unset", "empty"])
def test_launcher_refuses_to_start_without_a_broker(env, tmp_path):
    proc = subprocess.run(["/bin/sh", str(LAUNCHER), "name"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=20, stdin=subprocess.DEVNULL)
    assert proc.returncode != 0
    assert "TENSORTURN_BROKER_URL" in proc.stderr


