"""Benchmarks: `rollwise bench NAME`; each module has main(argv) -> int."""
