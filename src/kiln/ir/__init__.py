"""kiln's intermediate representation: dtypes, symbolic dimensions, the op set, and the program graph.

Shared by the exporter (which builds it) and the runtime (which loads it); imports nothing but NumPy.
"""
