"""The test suite (a package, so pytest puts the repository root on sys.path, never tests/:
with tests/ first, tests/engine_worker would shadow the real engine_worker package)."""
