"""Types of the native chained hashing (``_chainhash.c``); see :mod:`zkv.scheduler.hashing`."""

from collections.abc import Sequence

from zkv.scheduler.hashing import BlockHash

def hash_tokens(tokens: list[int] | tuple[int, ...] | bytes, block_size: int, parent: bytes,
                extras: dict[int, bytes] | None, /) -> list[BlockHash] | None: ...
def hash_id_list(ids: Sequence[int], parent: bytes, /) -> list[BlockHash] | None: ...
