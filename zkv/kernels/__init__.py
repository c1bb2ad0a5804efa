"""Block copy backends (torch-CPU, CuPy) and a slow reference oracle."""
