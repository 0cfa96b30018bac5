"""Workloads: Mooncake JSON lines (plain or gzip), the seeded synthetic generator, bundled traces."""
