# Targets: test (default CPU tier), test-slow (the slower matrices), test-zoo (every zoo cell: tests/zoo),
# test-zoo-inductor (the zoo's default tier lowered by Inductor instead of aot_eager),
# test-gpu (GPU tier, needs CUDA), test-triton-aot (compile-only sm90/sm100 check), bench, lint.
PYTHON ?= python
PYTEST_WORKERS ?= 2
BENCH_ARGS ?=  # e.g. --bench-threads 1, --bench-suite gpu-quick, --benchmark-json out.json (bench/README.md)

.PHONY: test test-slow test-zoo test-zoo-inductor test-gpu test-triton-aot bench lint format

test:
	$(PYTHON) -m pytest tests -q -m "not gpu and not slow" -n $(PYTEST_WORKERS) --durations=15

test-slow:
	$(PYTHON) -m pytest tests -q -m "slow and not gpu" -n $(PYTEST_WORKERS) --durations=15

test-zoo:
	ZOO_FULL=1 $(PYTHON) -m pytest tests/zoo -q -m "not gpu" -n $(PYTEST_WORKERS) --durations=15

test-zoo-inductor:
	ZOO_LOWERING=inductor $(PYTHON) -m pytest tests/zoo -q -m "not gpu" -n $(PYTEST_WORKERS) --durations=15

test-gpu:
	$(PYTHON) -m pytest tests -q -m gpu

# Every Triton launch compiled for sm90 and sm100 without a GPU, registers and spills per config (slow: tens of minutes on 2 cores).
test-triton-aot:
	$(PYTHON) tests/triton_aot.py --sm 90 100 --report

bench:
	$(PYTHON) -m pytest bench -q -rs --benchmark-only --benchmark-group-by=group --benchmark-columns=min,median,mean,rounds $(BENCH_ARGS)

lint:
	ruff check quantpass tests bench
	ruff format --check quantpass tests bench

format:
	ruff check --fix quantpass tests bench
	ruff format quantpass tests bench
