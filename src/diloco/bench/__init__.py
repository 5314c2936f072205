"""The benchmarks behind `make bench` and `make bench-gpu`: each module measures one cost against a floor
timed in the same run and writes `results/bench/<name>.json` and a table (`common` holds the table,
the record and the shared floors). `scripts/bench_<name>.py` runs a module's `main`; nothing here is
imported by training code."""
