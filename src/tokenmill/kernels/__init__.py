"""Native CPU kernels (C, built on first use) behind thin Python wrappers; see cpu_kernels.py."""
