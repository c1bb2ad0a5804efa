"""Only the optional C extension; all metadata lives in pyproject.toml.

``zkv.kernels._blockcopy`` speeds up the CPU copy backend; ``zkv.scheduler._chainhash``
hashes token lists natively (XXH3-128 from the vendored ``third_party/xxhash/xxhash.h``).
Both are ``optional=True``: where they cannot be built (no compiler), the install still
succeeds and zkv falls back to a ctypes memmove loop and to the pure-Python hashing path.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "zkv.kernels._blockcopy",
            ["zkv/kernels/_blockcopy.c"],
            optional=True,
        ),
        Extension(
            "zkv.scheduler._chainhash",
            ["zkv/scheduler/_chainhash.c"],
            include_dirs=["third_party/xxhash"],
            depends=["third_party/xxhash/xxhash.h"],
            optional=True,
        ),
    ]
)
