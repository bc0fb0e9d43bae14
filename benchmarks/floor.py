"""The CPU floor of a verified block operation (issue 30 point 1): what the mutual-TLS socket ceiling spends on the
same octets in the same run, plus one SHA-256 pass over the block per digest the operation computes -- measured in
the same run with hashlib -- so that "ours / floor" says what is still ours to cut, on a machine whose wall-clock
ratios are bent by two shared cores.

The passes, per operation (spec, "Block Retrieval and Storage"): a GET's client verifies ``Repr-Digest`` (one pass)
and, in the replica's codec, the layer digests (one more: :data:`GET_PASSES_SPEC`); the holder sends the digest it
stored with the block (none). A PUT's holder computes the layer digests of what it stores (one pass); the client's
container is encoded beforehand (none). A benchmark whose client checks less than the spec asks says so and passes
its own count.
"""

from __future__ import annotations

import hashlib
import statistics
import time

GET_PASSES_SPEC = 2  # Repr-Digest + the layer digests, on the client
PUT_PASSES = 1  # the layer digests, on the holder


def sha256_cpu_ms(octets: int, reps: int = 5) -> float:
    """CPU milliseconds of one SHA-256 pass over *octets* octets (the median of *reps*, on warm memory)."""
    data = bytes(octets)
    hashlib.sha256(data).digest()
    samples = []
    for _ in range(reps):
        t0 = time.process_time()
        hashlib.sha256(data).digest()
        samples.append(time.process_time() - t0)
    return statistics.median(samples) * 1e3


def floor_ms(socket_cpu_ms: float, sha_ms: float, passes: int) -> float:
    """The floor of one operation: the socket ceiling's CPU (client + server) and *passes* SHA-256 passes."""
    return socket_cpu_ms + passes * sha_ms


__all__ = ["GET_PASSES_SPEC", "PUT_PASSES", "floor_ms", "sha256_cpu_ms"]
