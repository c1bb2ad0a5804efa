"""Only the optional C extension; all metadata lives in pyproject.toml.

``zkv.kernels._blockcopy`` speeds up the CPU copy backend. ``optional=True``: where it
cannot be built (no compiler), the install still succeeds and the backend falls back to
a ctypes memmove loop.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "zkv.kernels._blockcopy",
            ["zkv/kernels/_blockcopy.c"],
            optional=True,
        )
    ]
)
