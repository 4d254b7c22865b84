"""``--sync overlap``: shards handed over while they upload. A shard task that ends hands its
shard over and uploads it in the background under a lease (``upload-r<r>-<k>``, held by a token,
refreshed while the upload runs); the round's handed set says which shards' tasks ended. A lease
that lapses before its shard is stored is an upload lost: the shard is taken back and trained
again.
"""

from __future__ import annotations

from typing import Any

from tensorturn import layout


class UploadLeases:
    """A run's background uploads: who holds each, and which shards were handed over."""

    def __init__(self, client: Any):
        self.r = client

    def hand_over(self, run_id: str, r: int, k: int, token: str, lease_s: float) -> None:
        """Shard ``k`` of round ``r`` ended its task and uploads in the background: its upload's
        lease (held by ``token``, ``lease_s`` seconds unless refreshed) first, then the handed set."""
        pipe = self.r.pipeline()
        pipe.set(layout.upload_key(run_id, r, k), token, px=int(lease_s * 1000))
        pipe.sadd(layout.handed_key(run_id, r), str(k))
        pipe.execute()

    def refresh_upload(self, run_id: str, r: int, k: int, token: str, lease_s: float) -> bool:
        """Extend the lease while ``token`` holds it; False when it lapsed or another holds it."""
        return bool(self.r.eval(_REFRESH_IF_HELD, 1, layout.upload_key(run_id, r, k), token,
                                int(lease_s * 1000)))

    def upload_ended(self, run_id: str, r: int, k: int, token: str) -> None:
        """The upload ended (stored, or failed): its lease goes, unless another upload holds it."""
        self.r.eval(_DELETE_IF_HELD, 1, layout.upload_key(run_id, r, k), token)

    def uploading(self, run_id: str, r: int, k: int) -> bool:
        return bool(self.r.exists(layout.upload_key(run_id, r, k)))

    def handed(self, run_id: str, r: int) -> set[int]:
        """Round ``r``'s shards whose task ended: stored, or uploading (or its upload lost)."""
        return {int(k) for k in self.r.smembers(layout.handed_key(run_id, r))}

    def take_back(self, run_id: str, r: int, k: int) -> bool:
        """Shard ``k`` of round ``r`` is to be trained again (its upload was lost): True for the
        one caller that took it back."""
        return bool(self.r.srem(layout.handed_key(run_id, r), str(k)))

    def forget_uploads(self, run_id: str, rounds: range, shards: int) -> None:
        """No shard of ``rounds`` handed over or uploading (a resume: their tasks run again)."""
        keys = [layout.handed_key(run_id, r) for r in rounds]
        keys += [layout.upload_key(run_id, r, k) for r in rounds for k in range(shards)]
        if keys:
            self.r.delete(*keys)


_REFRESH_IF_HELD = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end
return 0
"""
_DELETE_IF_HELD = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""
