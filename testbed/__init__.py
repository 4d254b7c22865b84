"""Test and benchmark tooling beside the runtime package: emulated links, an S3 endpoint."""
