"""The object store and what lives in it: files on a disk or an S3 bucket behind one ``Store``
(multipart, ranges, retries), safetensors bytes and per-tensor files, the codecs of deltas, and
the signed seals that say an object is the one a run wrote."""
