"""The torch-free runtime: load a .kiln file, validate it, and run its methods on a backend.

Imports NumPy (and a backend's own library when that backend is used), never torch; a test enforces it.
"""

from kiln.runtime.program import MethodInfo, Program, load
from kiln.runtime.session import Session

__all__ = ["MethodInfo", "Program", "Session", "load"]
