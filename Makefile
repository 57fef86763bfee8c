# Targets: test (default CPU tier), test-slow (the rest of the slower matrices), test-gpu (GPU tier, needs CUDA), bench, lint.
PYTHON ?= python
PYTEST_WORKERS ?= 2
BENCH_ARGS ?=  # e.g. --bench-threads 1, --bench-suite gpu-quick, --benchmark-json out.json (bench/README.md)

.PHONY: test test-slow test-gpu bench lint format

test:
	$(PYTHON) -m pytest tests -q -m "not gpu and not slow" -n $(PYTEST_WORKERS) --durations=15

test-slow:
	$(PYTHON) -m pytest tests -q -m "slow and not gpu" -n $(PYTEST_WORKERS) --durations=15

test-gpu:
	$(PYTHON) -m pytest tests -q -m gpu

bench:
	$(PYTHON) -m pytest bench -q -rs --benchmark-only --benchmark-group-by=group --benchmark-columns=min,median,mean,rounds $(BENCH_ARGS)

lint:
	ruff check quantpass tests bench
	ruff format --check quantpass tests bench

format:
	ruff check --fix quantpass tests bench
	ruff format quantpass tests bench
