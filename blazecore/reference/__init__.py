"""NumPy references: the obvious loop for every op, forward and backward."""
