"""Types of the native block copy (``_blockcopy.c``); see :mod:`zkv.kernels.cpu`."""

def copy_chunks(src_base: int, src_stride: int, dst_base: int, dst_stride: int, chunk_bytes: int,
                src_ids_addr: int, dst_ids_addr: int, n: int, /) -> None: ...
