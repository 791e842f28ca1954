"""`serve --data-parallel-size N`: N engine processes behind one port, balanced on load and prefix affinity."""
