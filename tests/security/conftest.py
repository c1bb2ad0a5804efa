"""The fault tests' ``ctx`` fixture serves here too (``folder``: tests/conftest.py)."""

from tests.faults.conftest import ctx

__all__ = ["ctx"]
