"""The fault tests' fixtures (``folder``, ``ctx``) serve here too."""

from tests.faults.conftest import ctx, folder

__all__ = ["ctx", "folder"]
